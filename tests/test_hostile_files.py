"""Hostile input files through the commands (issue 14, the matrix's bad-input rows not covered by
tests/test_inputs.py and tests/test_hostile.py): line endings, a 50 MB line, duplicate ids through a
pipe, a folder and a FIFO as INPUT, ids that spreadsheets and shells choke on, and `body.model`
naming another model or any path. No services: `run`, and `submit` on the embedded SQLite store."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import resource
import signal
import subprocess
import sys
import threading

import pytest

from tests.services import invoke, submit_job, write_requests

PLAIN = [{"id": f"p{i}", "prompt": f"def f{i}(x):", "max_tokens": 4, "temperature": 0} for i in range(3)]


def _env(tmp_path) -> dict[str, str]:
    return {**os.environ, "SPECQ_HOME": str(tmp_path / "home")}


def run_lines(path, out, tiny_pair, *extra: str) -> list[dict]:
    result = invoke(["run", str(path), "-o", str(out), "--target", tiny_pair[0], *extra])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def plain_outputs(tiny_pair, tmp_path) -> list[dict]:
    return run_lines(write_requests(tmp_path / "lf.jsonl", PLAIN), tmp_path / "lf.out", tiny_pair)


def test_crlf_line_endings_read_as_lf(plain_outputs, tiny_pair, tmp_path) -> None:
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b"".join(json.dumps(line).encode() + b"\r\n" for line in PLAIN))
    assert run_lines(path, tmp_path / "crlf.out", tiny_pair) == plain_outputs


def test_a_50_mb_line_is_a_line_error_and_nothing_runs(tiny_pair, tmp_path) -> None:
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"id": "big", "prompt": "x" * (50 << 20)}) + "\n" + json.dumps(PLAIN[0]) + "\n")
    out = tmp_path / "out.jsonl"
    result = invoke(["run", str(path), "-o", str(out), "--target", tiny_pair[0]])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"{path}:1: the line is longer than 1048576 bytes (the limit; raise it with --max-line-bytes or "
        "SPECQ_MAX_LINE_BYTES)",
        "Error: 1 bad line; nothing was done",
    ]
    assert not out.exists()


def test_duplicate_ids_through_a_pipe_are_line_errors(tiny_pair, tmp_path) -> None:
    lines = [json.dumps({"id": "a", "prompt": "x"}), json.dumps({"id": "a", "prompt": "y"})]
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        [sys.executable, "-P", "-m", "specq", "run", "/dev/stdin", "-o", str(out), "--target", tiny_pair[0]],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(tmp_path),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        '/dev/stdin:2: duplicate id "a" (first on line 1)',
        "Error: 1 bad line; nothing was done",
    ]
    assert not out.exists()


def test_a_folder_as_input_is_one_line(tiny_pair, tmp_path) -> None:
    result = invoke(["run", str(tmp_path), "-o", str(tmp_path / "o.jsonl"), "--target", tiny_pair[0]])
    assert result.exit_code == 2 and f"'{tmp_path}' is a directory" in result.output
    assert "Traceback" not in result.output


def test_a_fifo_as_input_is_read_once(plain_outputs, tiny_pair, tmp_path) -> None:
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in PLAIN)

    threading.Thread(target=feed, daemon=True).start()
    out = tmp_path / "fifo.out"
    args = ["run", str(fifo), "-o", str(out), "--target", tiny_pair[0]]
    try:
        done = subprocess.run(
            [sys.executable, "-P", "-m", "specq", *args], capture_output=True, text=True, timeout=20, env=_env(tmp_path)
        )
    finally:
        with contextlib.suppress(OSError), open(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK), "rb"):
            pass  # unblocks the feeder if the command never opened the FIFO
    assert done.returncode == 0, done.stderr
    assert [json.loads(line) for line in out.read_text().splitlines()] == plain_outputs


def test_ids_with_newlines_commas_and_quotes_survive_jsonl_and_csv(tiny_pair, tmp_path) -> None:
    ids = ["a\nb", "c,d", 'e"f', "g'h", "=1+2", " ", "\u2603\r"]
    lines = [{"id": i, "prompt": "def f(x):", "max_tokens": 2, "temperature": 0} for i in ids]
    path = write_requests(tmp_path / "in.jsonl", lines)
    assert [r["id"] for r in run_lines(path, tmp_path / "run.out", tiny_pair)] == ids
    env = {"SPECQ_HOME": str(tmp_path / "home")}  # the embedded SQLite store, in-process
    job_id = submit_job(env, path, "--target", tiny_pair[0], "--wait")
    out = tmp_path / "out.csv"
    assert invoke(["export", job_id, "-o", str(out), "--csv-raw"], env).exit_code == 0
    with open(out, encoding="utf-8", newline="") as f:  # newline="": a CR inside a cell stays a CR
        rows = list(csv.DictReader(f))
    assert [row["id"] for row in rows] == ids


def test_body_model_never_loads_another_model_or_path(plain_outputs, tiny_pair, tmp_path) -> None:
    """The job's target decodes every line whatever its `body.model` names: the draft's folder, a system
    file, a Hub id. The OpenAI output echoes the line's name (as OpenAI does), which loaded nothing."""
    names = [tiny_pair[1], "/etc/passwd", "gpt2"]
    lines = [
        {
            "custom_id": p["id"],
            "method": "POST",
            "url": "/v1/completions",
            "body": {**{k: v for k, v in p.items() if k != "id"}, "model": name},
        }
        for p, name in zip(PLAIN, names, strict=True)
    ]
    path = write_requests(tmp_path / "openai.jsonl", lines)
    outputs = run_lines(path, tmp_path / "openai.out", tiny_pair)
    assert [o["tokens"] for o in outputs] == [o["tokens"] for o in plain_outputs]
    env = {"SPECQ_HOME": str(tmp_path / "home")}
    job_id = submit_job(env, path, "--target", tiny_pair[0], "--wait")
    out = tmp_path / "batch.jsonl"
    assert invoke(["export", job_id, "-o", str(out), "--format", "openai"], env).exit_code == 0
    models = [json.loads(line)["response"]["body"]["model"] for line in out.read_text().splitlines()]
    assert models == names


def _full_disk_at(limit_bytes: int):
    """For a child process: files may not grow past `limit_bytes` (RLIMIT_FSIZE); a write past it fails
    with EFBIG, as on a full disk, instead of killing the process (SIGXFSZ ignored)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    return apply


def test_a_full_disk_for_the_results_database_is_one_line_and_stores_nothing(tiny_pair, tmp_path) -> None:
    env = _env(tmp_path)
    assert invoke(["db", "upgrade"], env).exit_code == 0  # the embedded SQLite store, made on a roomy disk
    lines = [{"id": f"r{i}", "prompt": "x" * 2000, "max_tokens": 2} for i in range(200)]  # ~400 kB of prompts
    path = write_requests(tmp_path / "in.jsonl", lines)
    done = subprocess.run(
        [sys.executable, "-P", "-m", "specq", "submit", path, "--target", tiny_pair[0]],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        preexec_fn=_full_disk_at(200_000),
    )
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert done.stderr.strip().splitlines() == [
        f"Error: could not store the job in the database at sqlite:///{tmp_path / 'home' / 'specq.db'} "
        "(disk I/O error; is its disk full?): nothing was stored"
    ], done.stderr
    result = invoke(["status", "--json"], env)
    assert result.exit_code == 0 and json.loads(result.stdout) == []
