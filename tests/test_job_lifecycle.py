"""A job's life as OpenAI Batch users run it, against the real services: metadata, a completion window
that expires what did not start, `submit --wait` exit codes and `--timeout`, `delete`, retention, and
plain progress lines where stderr is no terminal."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta

import pytest

from tests.services import count_rows, invoke, job_status, services_env, submit_job, write_requests

LINES = [
    {"id": "a", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0},
    {"id": "b", "prompt": "class A:", "max_tokens": 4, "temperature": 0},
]
TOO_LONG = {"id": "long", "prompt": "x", "max_tokens": 999}


@pytest.fixture
def queued_env(pg_db_url, redis_url, tmp_path):
    """PostgreSQL and a broker, and no worker: submitted jobs wait."""
    return services_env(pg_db_url, redis_url, tmp_path / "home")


def stored_counts(db_url) -> tuple[int, ...]:
    from specq.db.models import Batch, Job, Request, Result

    return tuple(count_rows(db_url, model) for model in (Job, Request, Result, Batch))


def test_metadata_is_stored_and_shown(queued_env, tiny_pair, pg_db_url, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES)
    args = ["--target", tiny_pair[0], "--metadata", "team=eval", "--metadata", "run=nightly 42", "--metadata", "e="]
    job_id = submit_job(queued_env, path, *args)
    assert job_status(queued_env, job_id)["metadata"] == {"team": "eval", "run": "nightly 42", "e": ""}
    text = invoke(["status", job_id], queued_env).stdout
    assert "team eval, run nightly 42" in text

    too_many = [arg for i in range(17) for arg in ("--metadata", f"k{i}=v")]
    for bad, says in (
        (["--metadata", "novalue"], "'novalue' is not KEY=VALUE"),
        (["--metadata", "=v"], "'=v' is not KEY=VALUE"),
        (["--metadata", "k" * 65 + "=v"], "keys are 64 characters at most"),
        (["--metadata", "k=" + "v" * 513], "values 512"),
        (["--metadata", "k=1", "--metadata", "k=2"], "'k' is given twice"),
        (too_many, "17 pairs given, 16 at most"),
    ):
        result = invoke(["submit", path, "--target", tiny_pair[0], *bad], queued_env)
        assert result.exit_code == 2 and says in result.stderr, result.output
    assert stored_counts(pg_db_url)[:2] == (1, 2)  # the first job alone


def test_a_window_that_ends_before_a_worker_comes_expires_the_job(
    queued_env, tiny_pair, start_worker, tmp_path
) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES)
    job_id = submit_job(queued_env, path, "--target", tiny_pair[0], "--completion-window", "1s")
    info = job_status(queued_env, job_id)
    assert info["completion_window"] == "1s" and info["state"] == "queued"
    assert datetime.fromisoformat(info["expires_at"]) <= datetime.now(UTC) + timedelta(seconds=1)
    time.sleep(1.2)
    start_worker(queued_env)  # its claim (or its sweeper) finds the window over: nothing runs
    deadline = time.monotonic() + 60
    while (info := job_status(queued_env, job_id))["state"] != "expired":
        assert time.monotonic() < deadline, info
        time.sleep(0.3)
    assert (info["completed"], info["failed"], info["remaining"]) == (0, 0, 2)
    out = tmp_path / "errors.jsonl"
    result = invoke(["export", job_id, "-o", str(out), "--format", "openai", "--errors-only"], queued_env)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [(line["custom_id"], line["error"]["code"]) for line in lines] == [
        ("a", "batch_expired"),
        ("b", "batch_expired"),
    ]

    result = invoke(["retry", job_id], queued_env)  # a retry lifts the window and runs them
    assert result.exit_code == 0, result.output
    deadline = time.monotonic() + 60
    while (info := job_status(queued_env, job_id))["state"] != "completed":
        assert time.monotonic() < deadline, info
        time.sleep(0.3)
    assert info["expires_at"] is None and info["completed"] == 2


def test_wait_ends_an_expired_job_with_no_worker_and_exits_1(queued_env, tiny_pair, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES)
    args = ["submit", path, "--target", tiny_pair[0], "--completion-window", "1s", "--wait"]
    result = invoke(args, queued_env)
    assert result.exit_code == 1, result.output
    job_id = result.stdout.strip()
    assert f"job {job_id} expired: 0 of 2 requests failed, 2 did not run" in result.stderr
    assert job_status(queued_env, job_id)["state"] == "expired"
    for bad in ("0s", "soon", "24"):
        result = invoke(["submit", path, "--target", tiny_pair[0], "--completion-window", bad], queued_env)
        assert result.exit_code == 2 and "is not a duration" in result.stderr


def test_wait_with_a_timeout_gives_up_and_leaves_the_job(queued_env, tiny_pair, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES)
    result = invoke(["submit", path, "--target", tiny_pair[0], "--wait", "--timeout", "1"], queued_env)
    assert result.exit_code == 1, result.output
    job_id = result.stdout.strip()
    assert f"gave up waiting after 1s: job {job_id} is queued and keeps running" in result.stderr
    assert job_status(queued_env, job_id)["state"] == "queued"
    result = invoke(["submit", path, "--target", tiny_pair[0], "--timeout", "1"], queued_env)
    assert result.exit_code == 2 and "--timeout needs --wait" in result.stderr
    embedded = {k: v for k, v in queued_env.items() if k != "SPECQ_BROKER_URL"}
    result = invoke(["submit", path, "--target", tiny_pair[0], "--wait", "--timeout", "1"], embedded)
    assert result.exit_code == 2 and "--timeout needs a broker" in result.stderr


def test_wait_exits_1_when_any_request_failed(pg_db_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, None, tmp_path / "home")  # embedded: the job runs in submit
    path = write_requests(tmp_path / "in.jsonl", [*LINES, TOO_LONG])
    result = invoke(["submit", path, "--target", tiny_pair[0], "--wait"], env)
    assert result.exit_code == 1, result.output
    job_id = result.stdout.strip()
    assert f"job {job_id} completed: 1 of 3 requests failed" in result.stderr
    info = job_status(env, job_id)
    assert (info["state"], info["completed"], info["failed"]) == ("completed", 2, 1)
    good = write_requests(tmp_path / "good.jsonl", LINES)
    assert invoke(["submit", good, "--target", tiny_pair[0], "--wait"], env).exit_code == 0


@pytest.mark.parametrize("store", ["postgresql", "sqlite"])
def test_delete_removes_the_job_and_all_it_holds(store, pg_db_url, redis_url, tiny_pair, tmp_path) -> None:
    db_url = pg_db_url if store == "postgresql" else f"sqlite:///{tmp_path / 'specq.db'}"
    embedded = services_env(db_url, None, tmp_path / "home")
    kept = submit_job(embedded, write_requests(tmp_path / "kept.jsonl", LINES), "--target", tiny_pair[0])
    done = submit_job(embedded, write_requests(tmp_path / "in.jsonl", LINES), "--target", tiny_pair[0])
    before = stored_counts(db_url)
    assert before == (2, 4, 4, before[3]) and before[3] >= 2
    result = invoke(["delete", done], embedded)
    assert result.exit_code == 0 and f"job {done} deleted with its 2 requests" in result.stderr, result.output
    assert stored_counts(db_url)[:3] == (1, 2, 2)
    assert job_status(embedded, kept)["completed"] == 2
    result = invoke(["delete", done], embedded)
    assert result.exit_code == 2 and f"no job has the id {done!r}" in result.stderr

    if store == "postgresql":  # a queued job: refused until cancelled
        queued = services_env(db_url, redis_url, tmp_path / "home")
        job_id = submit_job(queued, write_requests(tmp_path / "q.jsonl", LINES), "--target", tiny_pair[0])
        result = invoke(["delete", job_id], queued)
        assert result.exit_code == 2 and f"job {job_id} is queued: cancel it first" in result.stderr
        assert invoke(["cancel", job_id], queued).exit_code == 0
        assert invoke(["delete", job_id], queued).exit_code == 0
        assert stored_counts(db_url)[:2] == (1, 2)


def test_retention_prunes_old_ended_jobs_and_silent_workers(pg_db_url, tiny_pair, tmp_path, monkeypatch) -> None:
    from sqlalchemy import update

    from specq.db.models import Job, Worker
    from specq.db.session import open_database
    from specq.errors import ConfigError
    from specq.jobs.retention import prune, retention_from_env

    env = services_env(pg_db_url, None, tmp_path / "home")
    old = submit_job(env, write_requests(tmp_path / "old.jsonl", LINES), "--target", tiny_pair[0])
    new = submit_job(env, write_requests(tmp_path / "new.jsonl", LINES), "--target", tiny_pair[0])
    db = open_database(pg_db_url)
    long_ago = datetime.now(UTC) - timedelta(days=40)
    with db.session() as session:
        session.execute(update(Job).where(Job.id == old).values(finished_at=long_ago))
        session.add(Worker(name="gone", device="cpu", state="stopped", host="h", pid=1, heartbeat_at=long_ago))
        session.add(Worker(name="fresh", device="cpu", state="stopped", host="h", pid=2))
    assert prune(db, None) == (0, 1)  # no retention set: jobs are kept, silent workers' rows still go
    assert prune(db, timedelta(days=30)) == (1, 0)
    with db.session() as session:
        assert [j.id for j in session.query(Job)] == [new]
        assert [w.name for w in session.query(Worker)] == ["fresh"]

    monkeypatch.setenv("SPECQ_RETENTION", "30d")
    assert retention_from_env() == timedelta(days=30)
    monkeypatch.setenv("SPECQ_RETENTION", "a month")
    with pytest.raises(ConfigError, match="SPECQ_RETENTION: 'a month' is not a duration"):
        retention_from_env()


def test_progress_is_plain_lines_when_stderr_is_not_a_terminal(tiny_pair, tmp_path, monkeypatch) -> None:
    import specq.cli.progress

    monkeypatch.setattr(specq.cli.progress, "PLAIN_EVERY_S", 0.0)
    path = write_requests(tmp_path / "in.jsonl", LINES)
    result = invoke(["run", path, "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair[0]])
    assert result.exit_code == 0, result.output
    progress = [line for line in result.stderr.splitlines() if line.startswith("run: ")]
    assert progress and progress[-1].startswith("run: 2/2 done, 0 failed, ")
    assert "\x1b[" not in result.stderr  # no terminal control codes in a log
    quiet = invoke(["run", path, "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair[0], "--no-progress"])
    assert not [line for line in quiet.stderr.splitlines() if line.startswith("run: ")]
