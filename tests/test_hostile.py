"""Hostile input and faults (issue 14), through the commands as users run them, on the real services.

- `export -o` and `run -o` write through a FIFO, a device or a link to one, replace a link's target
  (never the link), and say in one line why a path cannot be written; `run` checks its input before it
  touches OUT.
- Hostile lines (deep nesting, a `role` that is an array, an integer past 64 bits) are `INPUT:LINE:`
  errors (exit 2); `--top-k` is bounded as the lines are.
- A temperature too small to sample with decodes exactly the greedy tokens.
- CSV export defuses formulas unless `--csv-raw`.
- `retry` after `cancel` says what it did or why it did nothing; `status ""` is refused.
- A bad SPECQ_LEASE_S is one line naming it, and only for the commands that need the queue's timings.
"""

from __future__ import annotations

import csv
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from specq.db.models import Request
from tests.services import count_rows, invoke, job_status, reference_greedy, services_env, submit_job, write_requests

LINES = [
    {"id": "a", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0},
    {"id": "=b", "prompt": "=HYPERLINK(1)", "max_tokens": 3, "temperature": 0},
]


@pytest.fixture
def finished_job(pg_db_url, tiny_pair, tmp_path):
    """(env, job id): LINES run to the end in-process (no broker), results in PostgreSQL."""
    env = services_env(pg_db_url, None, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", LINES)
    result = invoke(["submit", path, "--target", tiny_pair[0], "--wait"], env)
    assert result.exit_code == 0, result.output
    return env, result.stdout.strip()


def specq(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess[str]:
    """`specq ARGS` as a process of its own: its real standard output, and no test process to share."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "specq", *args], env=env, capture_output=True, text=True, timeout=120, **kwargs
    )


def read_fifo(fifo: Path) -> subprocess.Popen[bytes]:
    """A reader of `fifo` in another process (opening a FIFO blocks until both ends are open)."""
    return subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)


def one_error_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "Traceback" not in output, output
    return lines[0]


# -- 1. export -o: what the path is ---------------------------------------------------------------------
def test_export_writes_through_fifos_devices_and_links(finished_job, tmp_path) -> None:
    env, job_id = finished_job
    expected = tmp_path / "expected.jsonl"
    assert invoke(["export", job_id, "-o", str(expected)], env).exit_code == 0
    content = expected.read_bytes()
    assert content.count(b"\n") == 2

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    reader = read_fifo(fifo)
    result = invoke(["export", job_id, "-o", str(fifo)], env)
    out, _ = reader.communicate(timeout=30)
    assert result.exit_code == 0, result.output
    assert out == content and stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still the FIFO
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".specq-")) == []

    to_null = tmp_path / "null.jsonl"
    to_null.symlink_to("/dev/null")
    assert invoke(["export", job_id, "-o", str(to_null)], env).exit_code == 0
    assert os.readlink(to_null) == "/dev/null" and stat.S_ISCHR(os.stat("/dev/null").st_mode)

    # /dev/stdout, and a link to the process' own standard output: the bytes arrive on that pipe
    done = specq(["export", job_id, "-o", "/dev/stdout", "--format", "jsonl"], env)
    assert done.returncode == 0 and done.stdout.encode() == content, done.stderr
    assert os.path.islink("/dev/stdout")
    to_stdout = tmp_path / "stdout.jsonl"
    to_stdout.symlink_to("/proc/self/fd/1")
    done = specq(["export", job_id, "-o", str(to_stdout)], env)
    assert done.returncode == 0 and done.stdout.encode() == content, done.stderr
    assert os.readlink(to_stdout) == "/proc/self/fd/1"


def test_export_replaces_a_links_target_and_keeps_the_link(finished_job, tmp_path) -> None:
    env, job_id = finished_job
    target = tmp_path / "real" / "results.jsonl"
    target.parent.mkdir()
    target.write_text("old\n")
    os.chmod(target, 0o640)
    link = tmp_path / "latest.jsonl"
    link.symlink_to(target)
    assert invoke(["export", job_id, "-o", str(link)], env).exit_code == 0
    assert os.readlink(link) == str(target)
    assert [json.loads(line)["id"] for line in target.read_text().splitlines()] == ["a", "=b"]
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640  # the replaced file's mode is kept
    assert sorted(p.name for p in target.parent.iterdir()) == ["results.jsonl"]  # no temporary file left


def test_export_to_a_path_that_cannot_be_written(finished_job, tmp_path) -> None:
    env, job_id = finished_job
    missing = tmp_path / "nope" / "out.csv"
    result = invoke(["export", job_id, "-o", str(missing)], env)
    assert result.exit_code == 2
    assert one_error_line(result.stderr) == f"Error: cannot write {missing}: the folder {missing.parent} does not exist"
    result = invoke(["export", job_id, "-o", "/sys/specq-out.csv"], env)  # read-only, even for root
    assert result.exit_code == 2
    assert one_error_line(result.stderr).startswith("Error: cannot write /sys/specq-out.csv: ")


# -- 2. run -o: the input first ---------------------------------------------------------------------------
def test_run_checks_the_input_before_it_touches_out(tiny_pair, tmp_path) -> None:
    out = tmp_path / "out.jsonl"
    out.write_text("precious\n")
    bad = write_requests(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"prompt": 5}])
    result = invoke(["run", bad, "-o", str(out), "--target", tiny_pair[0]])
    assert result.exit_code == 2 and "nothing was done" in result.output
    assert out.read_text() == "precious\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    good = write_requests(tmp_path / "good.jsonl", LINES)
    result = invoke(["run", good, "-o", str(tmp_path / "missing" / "o.jsonl"), "--target", tiny_pair[0]])
    assert result.exit_code == 2
    assert one_error_line(result.stderr).startswith(f"Error: cannot write {tmp_path / 'missing' / 'o.jsonl'}: ")

    link = tmp_path / "link.jsonl"
    link.symlink_to(out)
    result = invoke(["run", good, "-o", str(link), "--target", tiny_pair[0]])
    assert result.exit_code == 0, result.output
    assert os.readlink(link) == str(out)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "=b"]

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    reader = read_fifo(fifo)
    result = invoke(["run", good, "-o", str(fifo), "--target", tiny_pair[0]])
    streamed, _ = reader.communicate(timeout=60)
    assert result.exit_code == 0, result.output
    assert streamed == out.read_bytes() and stat.S_ISFIFO(os.lstat(fifo).st_mode)


# -- 4, 5. hostile lines and bounds ------------------------------------------------------------------------
def test_hostile_lines_stop_run_and_submit_with_line_errors(pg_db_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, None, tmp_path / "home")
    lines = [
        "[" * 100_000 + "]" * 100_000,
        {"messages": [{"role": ["user"], "content": "hi"}]},
        {"prompt": "a", "top_k": 2**63},
        {"prompt": "a", "top_k": 2**64 - 1},
    ]
    path = write_requests(tmp_path / "in.jsonl", lines)
    expected = [
        f"{path}:1: not valid JSON: nested deeper than 1024 levels",
        f'{path}:2: "messages[0].role" must be one of "system", "developer", "user", "assistant", got array',
        f'{path}:3: "top_k" must be in [0, 2147483647], got {2**63}',
        f'{path}:4: "top_k" must be in [0, 2147483647], got {2**64 - 1}',
        "Error: 4 bad lines; nothing was done",
    ]
    for command in (["run", path, "-o", str(tmp_path / "o.jsonl")], ["submit", path]):
        result = invoke([*command, "--target", tiny_pair[0]], env)
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == expected
    assert not (tmp_path / "o.jsonl").exists()
    assert count_rows(pg_db_url, Request) == 0

    good = write_requests(tmp_path / "good.jsonl", LINES)
    result = invoke(["run", good, "-o", str(tmp_path / "o.jsonl"), "--target", tiny_pair[0], "--top-k", str(2**63)])
    assert result.exit_code == 2 and "2147483647" in result.output
    for option in ("--max-line-bytes", "--max-input-bytes"):  # read sizes: 2**70 overflowed readline
        result = invoke(["run", good, "-o", str(tmp_path / "o.jsonl"), "--target", tiny_pair[0], option, str(2**70)])
        assert result.exit_code == 2 and "is not in the range" in result.output and "Traceback" not in result.output


# -- 6. tiny temperatures --------------------------------------------------------------------------------
def test_tiny_temperatures_decode_greedily(tiny_pair, tmp_path) -> None:
    prompts = ["def add(a, b):", "class A:", "import os"]
    greedy = [{"id": f"g{i}", "prompt": p, "max_tokens": 12, "temperature": 0} for i, p in enumerate(prompts)]
    reference = reference_greedy(tiny_pair[0], greedy)
    lines = [
        {"id": f"{t}-{i}", "prompt": p, "max_tokens": 12, "temperature": t, "seed": 7}
        for t in (1e-40, 1e-300, 5e-324, 1e-6)
        for i, p in enumerate(prompts)
    ]
    path = write_requests(tmp_path / "in.jsonl", lines)
    for draft in ([], ["--draft", tiny_pair[1]]):
        out = tmp_path / "out.jsonl"
        result = invoke(["run", path, "-o", str(out), "--target", tiny_pair[0], *draft])
        assert result.exit_code == 0, result.output
        for record in map(json.loads, out.read_text().splitlines()):
            assert record["tokens"] == reference[f"g{record['id'].rsplit('-', 1)[1]}"], record["id"]
    # the job-wide option too
    out = tmp_path / "cli.jsonl"
    path = write_requests(
        tmp_path / "plain.jsonl", [{"id": g["id"], "prompt": g["prompt"], "max_tokens": 12} for g in greedy]
    )
    result = invoke(["run", path, "-o", str(out), "--target", tiny_pair[0], "--temperature", "1e-300"])
    assert result.exit_code == 0, result.output
    assert {r["id"]: r["tokens"] for r in map(json.loads, out.read_text().splitlines())} == reference


# -- 10. CSV injection --------------------------------------------------------------------------------------
def test_csv_export_defused_by_default_exact_with_csv_raw(finished_job, tmp_path) -> None:
    env, job_id = finished_job
    rows = {}
    for name, extra in (("default", []), ("raw", ["--csv-raw"])):
        out = tmp_path / f"{name}.csv"
        assert invoke(["export", job_id, "-o", str(out), *extra], env).exit_code == 0
        rows[name] = list(csv.DictReader(io.StringIO(out.read_text(encoding="utf-8"), newline="")))
    default, raw = rows["default"], rows["raw"]
    assert [r["id"] for r in raw] == ["a", "=b"] and raw[1]["prompt"] == "=HYPERLINK(1)"
    assert [r["id"] for r in default] == ["a", "'=b"] and default[1]["prompt"] == "'=HYPERLINK(1)"
    for d, r in zip(default, raw, strict=True):
        for column in ("prompt_tokens", "completion_tokens", "draft_tokens", "accepted_tokens", "status"):
            assert d[column] == r[column]
        assert d["completion"] == (("'" + r["completion"]) if r["completion"][:1] in "=+-@\t\r" else r["completion"])
    out = tmp_path / "exact.jsonl"
    assert invoke(["export", job_id, "-o", str(out)], env).exit_code == 0
    assert [json.loads(line)["prompt_tokens"] for line in out.read_text().splitlines()] == [
        int(r["prompt_tokens"]) for r in raw
    ]


# -- 12. retry after cancel; an empty job id ------------------------------------------------------------------
@pytest.fixture
def queued_env(pg_db_url, redis_url, tmp_path):
    return services_env(pg_db_url, redis_url, tmp_path / "home")


def test_retry_right_after_cancel_says_what_it_did(queued_env, tiny_pair, tmp_path) -> None:
    from specq.db.session import open_database
    from specq.queue import CHUNK_QUEUE_KEY
    from specq.worker.claims import cancel_claimed, claim_chunk

    env = queued_env
    lines = [{"prompt": f"def f{i}():", "max_tokens": 4} for i in range(8)]
    path = write_requests(tmp_path / "in.jsonl", lines)
    job_id = submit_job(env, path, "--target", tiny_pair[0], "--batch-size", "1")
    db = open_database(env["SPECQ_DATABASE_URL"])
    with db.session() as session:  # a worker has claimed the first chunk and is running it
        claimed = [c.id for c in claim_chunk(session, job_id, 0, 4, "w1", lease_s=60)]
    assert len(claimed) == 4

    result = invoke(["cancel", job_id], env)
    assert result.exit_code == 0 and "4 queued requests will not run" in result.output
    result = invoke(["retry", job_id], env)  # the worker has not seen the cancel yet
    assert result.exit_code == 2
    assert one_error_line(result.stderr) == (
        f"Error: job {job_id} is cancelled and 4 of its requests are still running until their workers see the "
        "cancel; nothing was requeued: retry again in a few seconds"
    )
    assert job_status(env, job_id)["state"] == "cancelled"

    with db.session() as session:  # ... now it has, and gives its claims up
        assert cancel_claimed(session, job_id, claimed, "w1") == 4
    redis.Redis.from_url(env["SPECQ_BROKER_URL"]).delete(CHUNK_QUEUE_KEY)
    result = invoke(["retry", job_id], env)
    assert result.exit_code == 0, result.output
    assert f"job {job_id} (cancelled -> queued): 8 requests requeued (8 cancelled)" in result.stderr
    assert job_status(env, job_id)["state"] == "queued"
    assert redis.Redis.from_url(env["SPECQ_BROKER_URL"]).llen(CHUNK_QUEUE_KEY) == 2

    result = invoke(["retry", job_id], env)  # nothing failed or cancelled now: nothing is sent again
    assert result.exit_code == 2
    assert one_error_line(result.stderr) == (
        f"Error: job {job_id} (queued) has no failed, cancelled or expired requests; nothing was requeued"
    )
    assert redis.Redis.from_url(env["SPECQ_BROKER_URL"]).llen(CHUNK_QUEUE_KEY) == 2


def test_retry_of_a_job_with_nothing_to_retry(finished_job) -> None:
    env, job_id = finished_job
    result = invoke(["retry", job_id], env)
    assert result.exit_code == 2
    assert one_error_line(result.stderr) == (
        f"Error: job {job_id} (completed) has no failed, cancelled or expired requests; nothing was requeued"
    )


def test_an_empty_job_id_is_refused(finished_job) -> None:
    env, _ = finished_job
    for command in (
        ["status", ""],
        ["status", " ", "--json"],
        ["export", "", "-o", "x.csv"],
        ["cancel", ""],
        ["retry", ""],
    ):
        result = invoke(command, env)
        assert result.exit_code == 2, command
        assert "a job id must not be empty" in result.output, command


# -- 11. a bad queue setting --------------------------------------------------------------------------------
def test_bad_queue_timings_are_one_line_for_the_commands_that_use_them(pg_db_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, None, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", LINES[:1])
    for value, message in (
        ("abc", "Error: SPECQ_LEASE_S must be a finite number of seconds, got 'abc'"),
        ("inf", "Error: SPECQ_LEASE_S must be a finite number of seconds, got 'inf'"),
        (
            "1",
            "Error: bad queue timings (SPECQ_LEASE_S=1): lease_s must cover at least 3 heartbeats, "
            "so one late beat loses no lease",
        ),
    ):
        bad = {**env, "SPECQ_LEASE_S": value}
        done = specq(["submit", path, "--target", tiny_pair[0]], bad)
        assert done.returncode == 2, done.stderr
        assert one_error_line(done.stderr) == message
        # commands that do not use the queue's timings are not disturbed
        assert specq(["--help"], bad).returncode == 0
        done = specq(["status"], bad)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        if value == "abc":  # the value that disturbs any reader of it (the others pass its parse); a decode is seconds
            done = specq(["run", path, "-o", str(tmp_path / "o.jsonl"), "--target", tiny_pair[0]], bad)
            assert done.returncode == 0, done.stderr
    assert count_rows(pg_db_url, Request) == 0
