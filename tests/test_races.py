"""Job-control races (issue 14, item 3): `cancel`, `retry` and workers claiming and settling a chunk,
with the race window held open by a row lock from a second connection, on the real PostgreSQL.

Each transaction that changes a job's state takes the job's row lock first (`db.locks`), so:

- a `retry` issued while a worker is still giving up a cancelled job's requests runs wholly before or
  after it, and the job ends (the bug: it stayed `running` for ever, its requests `cancelled`);
- a `cancel` and a claim of the same queued job never deadlock (they took their locks in opposite
  orders: the claim its requests then the job, the cancel the job then its requests).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from sqlalchemy import func, select

from specq.db.models import Request, Result
from specq.db.session import open_database
from specq.worker.claims import cancel_claimed, claim_chunk
from tests.fleet_helpers import DRILL_ENV, wait_for
from tests.services import invoke, job_status, request_states, services_env, submit_job, wait_state, write_requests


def libpq_url(sqlalchemy_url: str) -> str:
    return sqlalchemy_url.replace("postgresql+psycopg://", "postgresql://", 1)


@contextmanager
def job_row_locked(db_url: str, job_id: str):
    """The job's row locked FOR UPDATE by a second connection until the block ends."""
    with psycopg.connect(libpq_url(db_url)) as conn:
        conn.execute("SELECT id FROM jobs WHERE id = %s FOR UPDATE", (job_id,))
        yield conn
    # leaving psycopg's `with` commits, which releases the lock


def lock_waiters(db_url: str) -> int:
    """Sessions of this database waiting for a lock."""
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()
    return int(row[0]) if row else 0


class Background(threading.Thread):
    """`fn()` in a thread; `.result()` returns its value or raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # handed to the test by result()
            self.error = exc

    def result(self, timeout: float = 30.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "still blocked"
        if self.error is not None:
            raise self.error
        return self.value


def specq_process(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-P", "-m", "specq", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture
def queued_job(pg_db_url, redis_url, tiny_pair, tmp_path):
    """(env, job id): 8 greedy requests in two chunks of 4, queued, no worker yet."""
    env = services_env(pg_db_url, redis_url, tmp_path / "home", **DRILL_ENV)
    lines = [{"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 8, "temperature": 0} for i in range(8)]
    path = write_requests(tmp_path / "in.jsonl", lines)
    return env, submit_job(env, path, "--target", tiny_pair[0], "--batch-size", "1")


def test_retry_while_a_worker_settles_a_cancel_ends_the_job(queued_job, start_worker) -> None:
    env, job_id = queued_job
    db_url = env["SPECQ_DATABASE_URL"]
    db = open_database(db_url)
    with db.session() as session:  # a worker holds the first chunk ...
        held = [c.id for c in claim_chunk(session, job_id, 0, 4, "w1", lease_s=60)]
    assert len(held) == 4
    assert invoke(["cancel", job_id], env).exit_code == 0  # ... when the job is cancelled

    with job_row_locked(db_url, job_id):  # the window: the worker has seen the cancel, not yet settled
        retry = specq_process(["retry", job_id], env)
        wait_for(lambda: lock_waiters(db_url) == 1, 30, "the retry to wait for the job's lock")

        def settle() -> Any:
            with db.session() as session:
                return cancel_claimed(session, job_id, held, "w1")

        settling = Background(settle)
        wait_for(lambda: lock_waiters(db_url) == 2, 30, "the worker's settle to wait for the job's lock")
    _, stderr = retry.communicate(timeout=60)
    settled = settling.result()
    # the retry went first: it saw the worker's requests still running and changed nothing, saying so;
    # the worker then gave them up with the job, which was still cancelled
    assert retry.returncode == 2 and "still running until their workers see the cancel" in stderr, stderr
    assert settled == 4
    assert job_status(env, job_id)["state"] == "cancelled"

    result = invoke(["retry", job_id], env)
    assert result.exit_code == 0 and "8 requests requeued (8 cancelled)" in result.stderr, result.output
    start_worker(env)
    info = wait_state(env, job_id, {"completed", "failed", "cancelled"}, timeout=120)
    assert (info["state"], info["completed"], info["failed"]) == ("completed", 8, 0), info
    with db.session() as session:
        assert request_states(session, job_id) == {"completed": 8}
        results = select(func.count()).select_from(Result).join(Request).where(Request.job_id == job_id)
        assert session.scalar(results) == 8


def test_cancel_and_a_claim_of_a_queued_job_do_not_deadlock(queued_job) -> None:
    env, job_id = queued_job
    db_url = env["SPECQ_DATABASE_URL"]
    db = open_database(db_url)
    with job_row_locked(db_url, job_id):  # the cancel waits for the job's lock first ...
        cancel = specq_process(["cancel", job_id], env)
        wait_for(lambda: lock_waiters(db_url) == 1, 30, "the cancel to wait for the job's lock")

        def claim() -> int:
            with db.session() as session:
                return len(claim_chunk(session, job_id, 0, 4, "w1", lease_s=60))

        claiming = Background(claim)  # ... then a worker's claim of the same job
        wait_for(lambda: lock_waiters(db_url) == 2, 30, "the claim to wait")
    _, stderr = cancel.communicate(timeout=60)
    assert cancel.returncode == 0 and "8 queued requests will not run" in stderr, stderr
    assert claiming.result() == 0  # it found the job cancelled, and claimed nothing
    with db.session() as session:
        assert request_states(session, job_id) == {"cancelled": 8}
