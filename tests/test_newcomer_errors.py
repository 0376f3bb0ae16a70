"""A newcomer's mistakes answered at once, in one line (issue 51, items 4 and 5).

- A missing `.gguf` path, a missing folder, an empty or incomplete folder: reported before torch or
  transformers is imported (the budget is the imports, read with `python -X importtime`, not the clock), in
  one `Error:` line that names what is missing.
- A Hugging Face id with no hub in reach (an endpoint whose port refuses, or HF_HUB_OFFLINE) and no copy in
  the local cache: one line naming the id and what needs no hub; no retry chatter, no line twice.
- Runtime errors about a value (no such job, no such input file) print one `Error:` line without click's
  usage text; a usage mistake (a bad option value) keeps it.

Nothing here reaches the network: every hub endpoint is a local port that nothing listens on.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import invoke, services_env, write_requests

HEAVY = {"torch", "transformers", "huggingface_hub"}
CATALOGUE_NAME = "smollm2-135m-instruct"


@pytest.fixture
def closed_endpoint() -> str:
    """An http URL on this host whose port nothing listens on: a connection there is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def requests_file(tmp_path) -> str:
    return write_requests(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 2}])


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No proxy (the hub is probed directly), an empty Hugging Face cache, specq's data in tmp_path."""
    env = services_env(f"sqlite:///{tmp_path / 'specq.db'}", None, tmp_path / "home", HF_HOME=str(tmp_path / "hf"))
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(name, None)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_ENDPOINT"):
        env.pop(name, None)
    env.update(extra)
    return env


def _specq(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, list[str], set[str]]:
    """`specq ARGS` in a fresh interpreter: (exit code, the stderr lines meant for the user, the top-level
    packages it imported)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "specq", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    user_lines, imported = [], set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:"):
            imported.add(line.rsplit("|", 1)[-1].strip().split(".")[0])
        elif line.strip():
            user_lines.append(line)
    return done.returncode, user_lines, imported


def _model_folder(tmp_path: Path, files: tuple[str, ...]) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}")
    return str(folder)


@pytest.mark.parametrize(
    ("files", "says"),
    [
        ((), "is empty"),
        (("config.json",), "lacks tokenizer files"),
        (("tokenizer.json", "tokenizer_config.json"), "lacks config.json:"),
        (("README.md",), "lacks config.json and tokenizer files"),
    ],
)
def test_an_empty_or_incomplete_folder_names_what_it_lacks(tmp_path, requests_file, files, says) -> None:
    folder = _model_folder(tmp_path, files)
    code, lines, imported = _specq(["run", requests_file, "--target", folder], _env(tmp_path), tmp_path)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(f"Error: the folder {folder!r} {says}"), lines
    assert "config.json" in lines[0] and "tokenizer.json" in lines[0] and ".gguf" in lines[0]
    assert not imported & HEAVY, imported & HEAVY


@pytest.mark.parametrize(
    ("option", "name", "says"),
    [
        ("--target", "missing.gguf", "Error: the GGUF file 'missing.gguf' does not exist"),
        ("--target", "./no/such/model", "Error: no folder exists at './no/such/model', and it is not a Hugging Face"),
        ("--target", "models/no/draft", "Error: no folder exists at 'models/no/draft', and it is not a Hugging Face"),
        ("--draft", "./no/draft.gguf", "Error: the GGUF file './no/draft.gguf' does not exist"),
        ("--draft", "~/no-such-draft-folder", "Error: no folder exists at '~/no-such-draft-folder'"),
    ],
)
def test_a_missing_path_is_one_line_before_the_heavy_imports(tmp_path, requests_file, option, name, says) -> None:
    # a catalogue target passes the name check without being fetched: the draft is what is checked here
    target = [] if option == "--target" else ["--target", CATALOGUE_NAME]
    code, lines, imported = _specq(["run", requests_file, *target, option, name], _env(tmp_path), tmp_path)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith(says), lines
    assert not imported & HEAVY, imported & HEAVY


@pytest.mark.parametrize("command", ["run", "submit"])
def test_an_unreachable_hub_is_one_line_naming_the_id_and_what_needs_no_hub(
    tmp_path, requests_file, closed_endpoint, command
) -> None:
    env = _env(tmp_path, HF_ENDPOINT=closed_endpoint)
    code, lines, imported = _specq([command, requests_file, "--target", "someone/no-such-modell"], env, tmp_path)
    assert code == 1, lines  # the machine's failure (the id may be right), not the request's
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"Error: cannot reach the Hugging Face hub at {closed_endpoint}"), line
    assert "--target 'someone/no-such-modell'" in line and "local cache does not hold it" in line
    assert "local model folder" in line and ".gguf" in line and CATALOGUE_NAME in line and "specq models" in line
    assert "ngram" not in line  # a proposer is no target
    assert not imported & HEAVY, imported & HEAVY


def test_an_unreachable_hub_for_a_draft_also_offers_the_model_free_proposers(
    tmp_path, requests_file, closed_endpoint
) -> None:
    env = _env(tmp_path, HF_ENDPOINT=closed_endpoint)
    args = ["run", requests_file, "--target", CATALOGUE_NAME, "--draft", "someone/draft"]
    code, lines, _ = _specq(args, env, tmp_path)
    assert code == 1 and len(lines) == 1, lines
    assert "--draft 'someone/draft'" in lines[0] and "ngram or suffix" in lines[0], lines


def test_offline_and_not_cached_is_one_line(tmp_path, requests_file) -> None:
    env = _env(tmp_path, HF_HUB_OFFLINE="1")
    code, lines, _ = _specq(["run", requests_file, "--target", "gpt2"], env, tmp_path)
    assert code == 1 and len(lines) == 1, lines
    assert "'gpt2' is not in the local Hugging Face cache" in lines[0] and "HF_HUB_OFFLINE" in lines[0], lines


def test_a_cached_id_passes_with_the_hub_out_of_reach_and_is_read_offline(tmp_path, closed_endpoint) -> None:
    # a cached model must still load where the hub is down: read from the cache at once, no retries first
    snapshot = tmp_path / "hf" / "hub" / "models--someone--cached" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    script = (
        "import os, sys\n"
        "from specq.models.precheck import check_model_name\n"
        "check_model_name('someone/cached', '--target')\n"
        "print(os.environ.get('HF_HUB_OFFLINE'), sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    env = _env(tmp_path, HF_ENDPOINT=closed_endpoint)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1 []", done.stdout


def test_library_retry_chatter_is_silent_by_default_and_no_line_appears_twice(tmp_path) -> None:
    # huggingface_hub's own handler plus the root's printed each of its lines twice, and it warns at each retry
    script = (
        "import logging, sys\n"
        "from specq.cli.group import cli\n"
        "@cli.command('emit')\n"
        "def emit():\n"
        "    import huggingface_hub.utils  # gives its logger a handler of its own\n"
        "    logging.getLogger('huggingface_hub.utils._http').warning('Retrying in 1s [Retry 1/5].')\n"
        "    logging.getLogger('huggingface_hub.file_download').warning('a hub warning')\n"
        "cli.main(sys.argv[1:])\n"
    )

    def emitted(*flags: str) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", script, *flags, "emit"], env=_env(tmp_path), capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stderr.splitlines()

    quiet = emitted()
    assert not [line for line in quiet if "Retrying" in line], quiet
    assert [line for line in quiet if "a hub warning" in line] == ["a hub warning"], quiet
    verbose = emitted("-v")
    assert len([line for line in verbose if "Retrying in 1s" in line]) == 1, verbose
    assert len([line for line in verbose if "a hub warning" in line]) == 1, verbose


def test_runtime_errors_are_one_line_without_the_usage_text(tmp_path, requests_file) -> None:
    env = _env(tmp_path)
    missing = str(tmp_path / "missing.jsonl")
    for args, says in (
        (["status", "NOSUCHJOB"], "Error: no job has the id 'NOSUCHJOB'"),
        (["export", "NOSUCHJOB", "-o", str(tmp_path / "out.csv")], "Error: no job has the id 'NOSUCHJOB'"),
        (["run", missing, "--target", CATALOGUE_NAME], f"Error: Invalid value for 'INPUT.jsonl': File {missing!r}"),
        (["submit", missing, "--target", CATALOGUE_NAME], f"Error: Invalid value for 'INPUT.jsonl': File {missing!r}"),
        (["run", requests_file, "--target", str(tmp_path / "x.gguf")], "Error: the GGUF file"),
    ):
        result = invoke(args, env)
        assert result.exit_code == 2, (args, result.output)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(says), (args, lines)
        assert "Usage:" not in result.output


def test_a_usage_mistake_keeps_the_usage_text(tmp_path, requests_file) -> None:
    result = invoke(["run", requests_file, "--target", CATALOGUE_NAME, "--temperature", "9"], _env(tmp_path))
    assert result.exit_code == 2, result.output
    assert "Usage: " in result.stderr and "Invalid value for '--temperature'" in result.stderr


def test_a_complete_folder_a_gguf_folder_and_a_head_folder_pass_the_name_check(tmp_path) -> None:
    from specq.models.precheck import check_model_name

    complete = tmp_path / "complete"
    complete.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (complete / name).write_text(json.dumps({}))
    holding_gguf = tmp_path / "gguf"
    holding_gguf.mkdir()
    (holding_gguf / "model.gguf").write_bytes(b"GGUF")
    head = tmp_path / "head"
    head.mkdir()
    (head / "specq-head.json").write_text("{}")
    for folder in (complete, holding_gguf, head):
        check_model_name(str(folder), "--draft")
    check_model_name(CATALOGUE_NAME, "--target")


def test_the_head_marker_is_the_one_draft_heads_are_known_by() -> None:
    from specq.decoding.draft_head import HEAD_CONFIG
    from specq.models.precheck import HEAD_MARKER

    assert HEAD_MARKER == HEAD_CONFIG
