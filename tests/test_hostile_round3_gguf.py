"""Hostile GGUF files and chat templates, round 3 (issue 49, item 5 and the GGUF and template parts of
item 10): header bombs by count refused before any reader is built; a GGUF's own chat template held to
`--chat-template`'s limit; a damaged converted folder found and converted again, its load errors naming
it; a killed conversion's temporary folder removed by the next conversion of any file; a template's
`raise_exception` text and a GGUF's metadata escaped in messages. The GGUF files are written here, by
hand (struct) or with the gguf package's GGUFWriter; none needs a real model."""

from __future__ import annotations

import fcntl
import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from specq.errors import ModelLoadError, printable
from specq.limits import CHAT_TEMPLATE_BYTES, GGUF_TENSORS
from specq.models import gguf
from specq.models.gguf_header import check_header
from specq.paths import data_dir
from tests.services import invoke, write_requests

gguf_package = pytest.importorskip("gguf")

F32 = 0  # ggml's type ids
Q8_0 = 8
STRING, ARRAY, UINT32 = 8, 9, 4


# -- writing GGUF headers by hand -------------------------------------------------------------------------
def _string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _header(tensors: int, keys: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, keys)


def _tensor_info(name: str, dims: list[int], kind: int = F32, offset: int = 0) -> bytes:
    return _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)


# the one key a reader needs to go on to the tensors
ARCHITECTURE = _string("general.architecture") + struct.pack("<I", STRING) + _string("llama")


def small_tensors_file(path: Path, count: int) -> Path:
    """A well-formed file of `count` one-element f32 tensors, each at its aligned place."""
    infos = b"".join(_tensor_info(f"t{i}", [1], offset=32 * i) for i in range(count))
    head = _header(count, 1) + ARCHITECTURE + infos
    padding = -len(head) % 32
    path.write_bytes(head + b"\0" * padding + b"\0" * (32 * count))
    return path


def written_gguf(path: Path, architecture: str = "llama", chat_template: str | None = None) -> Path:
    """A small file as gguf's own writer lays it out: keys of each kind, arrays, tensors of two types."""
    writer = gguf_package.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_token_list(["<s>", "</s>", "a", "b"])
    writer.add_token_scores([0.0, 0.0, -1.0, -2.0])
    writer.add_custom_alignment(64)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    quantized = gguf_package.quantize(np.ones((2, 64), dtype=np.float32), gguf_package.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q.weight", quantized, raw_dtype=gguf_package.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def refusal(path: Path) -> str:
    with pytest.raises(ModelLoadError) as caught:
        check_header(path)
    message = str(caught.value)
    assert message.startswith(f"cannot load the GGUF file {str(path)!r} (") and "\n" not in message
    return message


@pytest.fixture
def readers_built(monkeypatch) -> list[str]:
    """The GGUF readers started while the test runs: gguf's GGUFReader and transformers' own (which
    maps the file first), one for each time a file is read."""
    from transformers.integrations.gguf import reader

    built: list[str] = []
    original_init, original_map = gguf_package.GGUFReader.__init__, reader._mapped

    def counting_init(self, path, *args, **kwargs):
        built.append(str(path))
        original_init(self, path, *args, **kwargs)

    def counting_map(path):
        built.append(str(path))
        return original_map(path)

    monkeypatch.setattr(gguf_package.GGUFReader, "__init__", counting_init)
    monkeypatch.setattr(reader, "_mapped", counting_map)
    return built


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error: ")]


def run_on(model: Path | str, tmp_path: Path, *extra: str, lines: list[dict] | None = None):
    requests = write_requests(tmp_path / "in.jsonl", lines or [{"prompt": "hi", "max_tokens": 2}])
    return invoke(["run", requests, "-o", str(tmp_path / "out.jsonl"), "--target", str(model), *extra])


# -- 5. header bombs by count -------------------------------------------------------------------------------
def test_three_million_declared_tensors_are_refused_before_any_reader(readers_built, tmp_path) -> None:
    bomb = tmp_path / "bomb.gguf"
    bomb.write_bytes(_header(3_000_000, 1) + ARCHITECTURE + b"".join(_tensor_info(f"t{i}", [1]) for i in range(64)))
    result = run_on(bomb, tmp_path)
    assert result.exit_code == 2, result.output
    assert error_lines(result.output) == [
        f"Error: cannot load the GGUF file {str(bomb)!r} (its header declares 3000000 tensors, over the limit "
        f"of {GGUF_TENSORS})"
    ]
    assert "Traceback" not in result.output
    assert readers_built == []  # refused from the header's counts: nothing was built from them
    left = [p.name for p in (data_dir() / gguf.CACHE_DIR).iterdir() if not p.name.endswith(".lock")]
    assert left == []  # no folder, not even a temporary one


def test_many_real_small_tensors_over_the_cap_are_refused_in_bounded_memory(readers_built, tmp_path) -> None:
    many = small_tensors_file(tmp_path / "many.gguf", GGUF_TENSORS + 1)
    tracemalloc.start()
    try:
        message = refusal(many)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"declares {GGUF_TENSORS + 1} tensors, over the limit of {GGUF_TENSORS}" in message
    assert peak < 1 << 20, peak  # the walk reads through a memory map; nothing grows with the file
    result = run_on(many, tmp_path)
    assert result.exit_code == 2 and len(error_lines(result.output)) == 1, result.output
    assert readers_built == []


def test_well_formed_headers_pass_the_walk(tmp_path) -> None:
    """The walk reads what gguf's writer writes (keys of each kind, string and number arrays, a custom
    alignment, a quantized tensor), so real files pass it; a real model's too where it is installed."""
    check_header(small_tensors_file(tmp_path / "few.gguf", 100))
    check_header(written_gguf(tmp_path / "written.gguf"))
    try:
        from tests.real_models import smollm2_gguf

        real = smollm2_gguf()
    except ImportError:
        return
    check_header(real)


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (_header(0, 2**63), f"declares {2**63} keys, over the limit of 65536"),
        (_header(0, 60_000) + b"\0" * 1000, "declares 60000 keys, more than its 1024 bytes can hold"),
        (_header(0, 1) + struct.pack("<Q", 2**64 - 1) + b"\0" * 16, "the name of key 0 has 18446744073709551615 bytes"),
        (_header(0, 1) + _string("k") + struct.pack("<IQ", STRING, 2**40), "the key 'k' runs past the end"),
        (_header(0, 1) + _string("k") + struct.pack("<IIQ", ARRAY, STRING, 2**22), "its arrays hold more than"),
        (_header(0, 1) + _string("k") + struct.pack("<IIQ", ARRAY, STRING, 10**5), "declares 100000 strings"),
        (_header(0, 1) + _string("k") + struct.pack("<IIQ", ARRAY, UINT32, 10**6), "the key 'k' runs past the end"),
        (_header(0, 1) + _string("k") + struct.pack("<I", 99) + b"\0" * 64, "the unknown value type 99"),
        (_header(0, 1) + _string("k") + struct.pack("<IIQIQIQIQIQ", ARRAY, *[ARRAY, 1] * 5), "nests arrays deeper"),
        (_header(1, 0) + _tensor_info("t", [1] * 9), "the tensor 't' has 9 dimensions, over the limit of 4"),
        (_header(1, 0) + _tensor_info("t", [1], kind=999), "the tensor 't' has the unknown ggml type 999"),
        (_header(1, 0) + _tensor_info("t", [31], kind=Q8_0), "has 31 elements, not whole blocks of 32"),
        (_header(1, 0) + _tensor_info("t", [2**40]), "the data of the tensor 't' runs past the end of the file"),
        (_header(1, 0) + _tensor_info("\x1b[2J\nforged", [2**40]), r"the tensor '\x1b[2J\nforged'"),
        (_header(0, 0, version=1), "GGUF version 1, which cannot be read"),
        (b"GGML" + b"\0" * 64, "it does not begin with GGUF"),
        (b"GGUF\3\0\0\0", "it has 8 bytes, too few for a GGUF header"),
    ],
)
def test_a_hostile_header_is_one_line_naming_what_is_wrong(body: bytes, why: str, tmp_path) -> None:
    path = tmp_path / "hostile.gguf"
    path.write_bytes(body)
    assert why in refusal(path)


def test_a_truncated_file_is_refused_by_its_tensor_data(tmp_path) -> None:
    whole = written_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:-80])  # past the padding that ends the file, into the last tensor
    assert "the data of the tensor 'q.weight' runs past the end of the file (truncated?)" in refusal(cut)


# -- 10. a GGUF's own chat template: the same limit as --chat-template -----------------------------------
def test_a_gguf_chat_template_over_the_limit_is_refused(readers_built, tmp_path) -> None:
    fits = "{# " + "x" * (CHAT_TEMPLATE_BYTES - 6) + " #}"
    assert len(fits) == CHAT_TEMPLATE_BYTES
    check_header(written_gguf(tmp_path / "fits.gguf", chat_template=fits))
    (tmp_path / "big").mkdir()
    big = written_gguf(tmp_path / "big" / "big.gguf", chat_template=fits + " ")
    assert f"has {CHAT_TEMPLATE_BYTES + 1} bytes, over the limit of 256 KiB (as for --chat-template)" in refusal(big)
    result = run_on(big, tmp_path)
    assert result.exit_code == 2, result.output
    assert len(error_lines(result.output)) == 1 and "chat template" in result.output
    assert readers_built == []


# -- 10. the converted folders: damage found and converted again; abandoned work removed ---------------------
@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """gguf._convert replaced by a quick one that writes a folder of the same kinds of files (a small
    config, a 9 MiB weights file hashed in samples); each conversion's source listed. The conversion's
    own code around it (lock, header check, record, cleanup) runs as it is."""
    done: list[Path] = []

    def convert(path: Path, into: Path, dtype: str = "float32") -> None:
        done.append(path)
        (into / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (into / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(9 << 20))

    monkeypatch.setattr(gguf, "_convert", convert)
    return done


def test_a_damaged_conversion_is_found_and_converted_again(conversions, tmp_path) -> None:
    source = written_gguf(tmp_path / "model.gguf")
    folder = gguf.converted_folder(source)
    assert gguf.converted_folder(source) == folder and len(conversions) == 1  # intact: read as it is
    weights = folder / "model.safetensors"
    damages = [
        lambda: weights.write_bytes(weights.read_bytes()[: 5 << 20]),  # cut short (a full disk, a bad copy)
        lambda: weights.write_bytes(b"\xff" * 64 + weights.read_bytes()[64:]),  # overwritten, same size
        lambda: weights.write_bytes(weights.read_bytes()[:-64] + b"\xff" * 64),  # its last bytes
        lambda: (folder / "config.json").write_text('{"model_type": "evil"}'),  # a small file, hashed whole
        lambda: (folder / "config.json").unlink(),
        lambda: (folder / gguf.DONE_FILE).write_text("{not json"),
    ]
    for count, damage in enumerate(damages, start=2):
        damage()
        assert gguf.converted_folder(source) == folder
        assert len(conversions) == count, damage
        assert (folder / "config.json").exists() and weights.stat().st_size == 9 << 20


def test_a_folder_converted_before_records_were_kept_is_recorded_not_converted(conversions, tmp_path) -> None:
    source = written_gguf(tmp_path / "model.gguf")
    folder = gguf.converted_folder(source)
    (folder / gguf.DONE_FILE).write_text(f"{source.resolve()}\n")  # as revision 1 wrote it
    assert gguf.converted_folder(source) == folder and len(conversions) == 1
    record = json.loads((folder / gguf.DONE_FILE).read_text())
    assert sorted(record["files"]) == ["config.json", "model.safetensors"]


def test_a_load_error_from_a_converted_folder_names_the_folder(monkeypatch, tmp_path) -> None:
    """A conversion whose files pass the record but do not load (damage the samples missed, a library
    that reads them differently now): the error says which folder to remove."""
    from specq.models.loading import load_config

    monkeypatch.setattr(gguf, "_convert", lambda path, into, dtype: (into / "config.json").write_text("{}"))
    source = written_gguf(tmp_path / "model.gguf")
    folder = gguf.converted_folder(source)
    with pytest.raises(ModelLoadError) as caught:
        load_config(str(source))
    assert str(caught.value).startswith(
        f"cannot load the model config of {str(source)!r} (converted into {str(folder)!r}) ("
    )


def test_a_killed_conversions_folder_is_removed_by_the_next_conversion_of_any_file(conversions, tmp_path) -> None:
    cache = data_dir() / gguf.CACHE_DIR
    cache.mkdir(parents=True)
    abandoned = cache / ".0123abcd-r1.tmp-xyz"  # another file's, its converter killed
    (abandoned / "sub").mkdir(parents=True)
    (abandoned / "sub" / "model.safetensors").write_bytes(b"half")
    running = cache / ".4567cdef-r1.tmp-abc"  # another file's, its converter at work (holding its lock)
    running.mkdir()
    source = written_gguf(tmp_path / "model.gguf")
    stat = source.stat()
    own_name = f"{gguf._sha256(str(source.resolve()), stat.st_size, stat.st_mtime_ns)}-r{gguf.REVISION}"
    own = cache / f".{own_name}.tmp-old"  # this very file's, its converter killed
    own.mkdir()
    with open(cache / ".4567cdef-r1.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        gguf.converted_folder(source)
        assert not abandoned.exists() and not own.exists()
        assert running.exists()
    assert len(conversions) == 1


# -- 10. untrusted text escaped in messages ----------------------------------------------------------------
FORGED = "bad\nin.jsonl:9: forged line\x1b[31m red\u2028more\u202eleft"


def test_printable_escapes_what_forges_lines_or_drives_terminals() -> None:
    assert printable(FORGED) == r"bad\nin.jsonl:9: forged line\x1b[31m red\u2028more\u202eleft"
    assert printable("caf\u00e9 \u2603 tab\tend") == "caf\u00e9 \u2603 tab\\tend"
    assert printable(FORGED).splitlines() == [printable(FORGED)]


def test_a_templates_raise_exception_text_is_escaped(tiny_pair, tmp_path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ raise_exception(" + json.dumps(FORGED) + ") }}")
    chat = {"id": "c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    result = run_on(tiny_pair[0], tmp_path, "--chat-template", str(template), lines=[chat])
    assert result.exit_code == 2, result.output
    assert "\x1b" not in result.output and "\u2028" not in result.output
    problems = result.stderr.splitlines()
    assert len(problems) == 2 and problems[1].startswith("Error: 1 bad line"), result.stderr
    assert problems[0].endswith(r"bad\nin.jsonl:9: forged line\x1b[31m red\u2028more\u202eleft"), problems[0]


def test_gguf_metadata_in_a_message_is_escaped(tmp_path) -> None:
    model = written_gguf(tmp_path / "odd.gguf", architecture="evil\x1b[2J\u2028Error: forged\nline")
    result = run_on(model, tmp_path)
    assert result.exit_code == 2, result.output
    assert "\x1b" not in result.output and "\u2028" not in result.output
    (line,) = error_lines(result.output)
    assert line.startswith(f"Error: cannot load the GGUF file {str(model)!r} (") and r"evil\x1b[2J" in line, line
