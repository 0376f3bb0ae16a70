"""The embedded default: no broker, the job runs inside `submit` through the workers' own task code."""

from __future__ import annotations

import json

from tests.services import invoke, job_status, reference_greedy, services_env, write_requests

LINES = [
    {"id": "g1", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0},
    {
        "custom_id": "c1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0},
    },
    {"id": "long", "prompt": "x", "max_tokens": 999},
    {"prompt": "class A:", "max_tokens": 4, "temperature": 0.7},
]


def test_embedded_sqlite_with_no_services_at_all(tiny_pair, tmp_path) -> None:
    env = {"SPECQ_HOME": str(tmp_path / "home")}  # no database URL, no broker: SQLite in SPECQ_HOME
    path = write_requests(tmp_path / "in.jsonl", LINES)
    result = invoke(["submit", path, "--target", tiny_pair[0], "--draft", tiny_pair[1], "--wait"], env)
    assert result.exit_code == 1, result.output  # one request failed (too long): a CI gate sees it
    job_id = result.stdout.strip()
    assert result.stdout == job_id + "\n"
    assert "running here (no broker)" in result.stderr
    assert (tmp_path / "home" / "specq.db").exists()
    info = job_status(env, job_id)
    assert (info["state"], info["completed"], info["failed"]) == ("completed", 3, 1)

    out = tmp_path / "out.jsonl"
    assert invoke(["export", job_id, "-o", str(out)], env).exit_code == 0  # jsonl from the extension
    records = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert list(records) == ["g1", "c1", "long", "4"]
    for request_id, tokens in reference_greedy(tiny_pair[0], LINES).items():
        assert records[request_id]["tokens"] == tokens

    result = invoke(["retry", job_id], env)  # runs in-process too; the too-long request fails again
    assert result.exit_code == 0, result.output
    assert "1 request requeued" in result.output and "3 completed, 1 failed" in result.output


def test_embedded_postgres_without_wait(pg_db_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, None, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", LINES[:2])
    result = invoke(["submit", path, "--target", tiny_pair[0]], env)
    assert result.exit_code == 0, result.output
    info = job_status(env, result.stdout.strip())
    assert (info["state"], info["completed"]) == ("completed", 2)


def test_bad_file_stores_nothing_in_sqlite(tiny_pair, tmp_path, sqlite_url) -> None:
    from specq.db.models import Job, Request
    from tests.services import count_rows

    path = write_requests(tmp_path / "bad.jsonl", [LINES[0], {"prompt": ""}, LINES[1]])
    result = invoke(["submit", path, "--target", tiny_pair[0], "--database-url", sqlite_url])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[0] == f'{path}:2: "prompt" must not be empty'
    assert count_rows(sqlite_url, Job) == 0 and count_rows(sqlite_url, Request) == 0
    listing = invoke(["status", "--json", "--database-url", sqlite_url])
    assert listing.exit_code == 0 and json.loads(listing.stdout) == []


def test_ctrl_c_cancels_the_embedded_job_so_retry_can_resume_it(tiny_pair, tmp_path) -> None:
    import os
    import signal
    import subprocess
    import sys

    from tests.fleet_helpers import wait_for

    env = {**os.environ, "SPECQ_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    for name in ("SPECQ_DATABASE_URL", "SPECQ_BROKER_URL"):
        env.pop(name, None)
    lines = [{"id": f"q{i}", "prompt": f"def f{i}(x):", "max_tokens": 64, "temperature": 0} for i in range(64)]
    path = write_requests(tmp_path / "in.jsonl", lines)
    args = [sys.executable, "-P", "-m", "specq", "submit", path, "--target", tiny_pair[0], "--batch-size", "1"]
    submit = subprocess.Popen(
        [*args, "--wait"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as a terminal sends it: a suite started in the background of a non-interactive shell
        # inherits SIGINT ignored, and so would the command, which then never sees the interrupt
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert submit.stdout is not None
    job_id = submit.stdout.readline().strip()  # printed once the job is stored, before it runs
    wait_for(lambda: job_status(env, job_id)["completed"] > 0, 60, "the job under way")
    submit.send_signal(signal.SIGINT)
    _, stderr = submit.communicate(timeout=60)
    assert submit.returncode == 130, stderr
    assert f"cancelled job {job_id} here" in stderr
    info = job_status(env, job_id)
    assert info["state"] == "cancelled" and 0 < info["completed"] < 64, info


def test_submit_wait_returns_only_after_its_work_thread_has_ended(tiny_pair, tmp_path, monkeypatch) -> None:
    """The job's end is stored before the thread that ran it is done; a process that exits with that
    thread still inside torch aborts ("terminate called without an active exception"), as a demo run
    did once. The thread here lingers a second past the job's end (two of wait's polls): submit must
    still be waiting for it."""
    import threading
    import time

    from specq.worker import embedded

    run_chunks_here, finished = embedded.run_chunks_here, threading.Event()

    def run_then_linger(*args, **kwargs):
        run_chunks_here(*args, **kwargs)
        time.sleep(1.0)
        finished.set()

    monkeypatch.setattr(embedded, "run_chunks_here", run_then_linger)
    env = {"SPECQ_HOME": str(tmp_path / "home")}
    path = write_requests(tmp_path / "in.jsonl", LINES[:1])
    result = invoke(["submit", path, "--target", tiny_pair[0], "--wait"], env)
    assert result.exit_code == 0, result.output
    assert finished.is_set()
