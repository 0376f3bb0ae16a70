"""Helpers of the fleet, recovery and hardening tests (and of benchmarks/load_run.py's drills): short
timings, waits, freezing a worker. The drills that restart a server restart one of their own
(tests/private_servers.py), never the machine's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

# short timings: a dead worker's leases expire in 3 s, sweepers run every second
DRILL_ENV = {"SPECQ_HEARTBEAT_S": "0.5", "SPECQ_LEASE_S": "3", "SPECQ_SWEEP_S": "1"}


# The least a wait waits before it calls a hang. A wait returns as soon as its condition holds, so this
# costs nothing when things work; it only keeps a 2-core machine that other work slows ten times over
# from failing a test that an idle one passes. The timeouts that callers give say how long the thing
# takes on an idle machine.
MIN_PATIENCE_S = 300.0


def patience(seconds: float) -> float:
    """How long to wait for what takes `seconds` on an idle machine before calling it a hang."""
    return max(seconds, MIN_PATIENCE_S)


def wait_for(check: Callable[[], Any], timeout: float, what: str, poll: float = 0.1) -> Any:
    """Poll `check()` until it returns something truthy; AssertionError naming `what` once it has not for
    `patience(timeout)` seconds."""
    timeout = patience(timeout)
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


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
