"""Helpers of the fleet, recovery and hardening tests (and of benchmarks/load_run.py's drills): restart the
real services, wait for things.

Both services are always left running, even when a restart fails half way (the start runs in a
`finally`). Redis keeps nothing on disk here, so a restart drops every key of every database: exactly
the loss the drills recover from.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import redis

from tests.services import PG_ADMIN_URL

REDIS_START = [
    "redis-server",
    "--daemonize",
    "yes",
    "--bind",
    "127.0.0.1",
    "-::1",
    "--port",
    "6379",
    "--save",
    "",
    "--appendonly",
    "no",
    "--dir",
    "/var/lib/redis",
    "--logfile",
    "/var/log/redis/ci.log",
]
# short timings: a dead worker's leases expire in 3 s, sweepers run every second
DRILL_ENV = {"SPECQ_HEARTBEAT_S": "0.5", "SPECQ_LEASE_S": "3", "SPECQ_SWEEP_S": "1"}


def wait_for(check: Callable[[], Any], timeout: float, what: str, poll: float = 0.1) -> Any:
    """Poll `check()` until it returns something truthy; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def redis_up() -> bool:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def restart_redis(down_s: float = 0.5) -> float:
    """Stop Redis (nothing saved: every queued message is gone) and start it again; the seconds it was
    down."""
    down = time.monotonic()
    try:
        subprocess.run(["redis-cli", "-h", "127.0.0.1", "shutdown", "nosave"], capture_output=True, timeout=30)
        wait_for(lambda: not redis_up(), 10, "Redis to stop")
        down = time.monotonic()
        time.sleep(down_s)
    finally:
        if not redis_up():
            Path("/var/log/redis").mkdir(parents=True, exist_ok=True)
            Path("/var/lib/redis").mkdir(parents=True, exist_ok=True)
            subprocess.run(REDIS_START, check=True, capture_output=True, timeout=30)
        wait_for(redis_up, 30, "Redis to start", poll=0.05)
    return time.monotonic() - down


def postgres_up() -> bool:
    try:
        with psycopg.connect(PG_ADMIN_URL, connect_timeout=1) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.OperationalError:
        return False


def _pg_ctl(action: str) -> None:
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", action],
        check=False,
        capture_output=True,
        timeout=120,
    )


@contextmanager
def postgres_stopped() -> Iterator[None]:
    """PostgreSQL stopped (fast shutdown: every connection is cut) for the block, started again after it
    whatever happens."""
    try:
        _pg_ctl("stop")
        wait_for(lambda: not postgres_up(), 30, "PostgreSQL to stop")
        yield
    finally:
        if not postgres_up():
            _pg_ctl("start")
        wait_for(postgres_up, 60, "PostgreSQL to start")


def restart_postgres(down_s: float = 1.0) -> float:
    """Stop PostgreSQL (fast shutdown: every connection is cut), wait `down_s`, start it again; the
    seconds it was down."""
    down = time.monotonic()
    try:
        _pg_ctl("stop")
        wait_for(lambda: not postgres_up(), 30, "PostgreSQL to stop")
        down = time.monotonic()
        time.sleep(down_s)
    finally:
        if not postgres_up():
            _pg_ctl("start")
        wait_for(postgres_up, 60, "PostgreSQL to start")
    return time.monotonic() - down


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def freeze_a_worker_mid_chunk(db: Any, job_id: str, workers: list[Any], total: int) -> Any:
    """The worker holding requests of the job while some of its results are stored, frozen (SIGSTOP) so
    that it cannot finish its chunk before the caller kills it; None (and thawed) when it got there first.
    Poll it with `wait_for(..., poll=0.02)`: a fast machine may finish a chunk between two looks."""
    import signal

    from sqlalchemy import func, select

    from specq.db.models import Request, Result

    def running(session: Any, owner: str | None = None) -> list[str]:
        query = select(Request.lease_owner).where(Request.job_id == job_id, Request.state == "running")
        return session.scalars(query if owner is None else query.where(Request.lease_owner == owner)).all()

    with db.session() as session:
        owners = running(session)
        done = session.scalar(select(func.count()).select_from(Result).join(Request).where(Request.job_id == job_id))
    if not owners or not 0 < (done or 0) < total:
        return None
    victim = next(w for w in workers if owners[0].endswith(f":{w.proc.pid}"))
    victim.proc.send_signal(signal.SIGSTOP)
    time.sleep(0.3)  # what it had already sent the database is applied by now
    with db.session() as session:
        if running(session, owners[0]):
            return victim
    victim.proc.send_signal(signal.SIGCONT)
    return None
