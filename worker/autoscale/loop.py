"""The autoscaler's loop: every `interval_s`, read the backlog, decide, start or stop workers, log.

The backlog is read from the database, which is the truth: requests queued plus running, over the
jobs that have not ended (their counters, so the read costs one small query however large the jobs).
The Redis list length is logged beside it, for information only: it counts chunks, not requests, and
misses chunks in workers' hands. If the database cannot be read, no decision is made that tick: the
workers wanted last time are kept (a dead one is replaced), none is stopped on missing information.

SIGTERM or SIGINT ends the loop: every worker is stopped gracefully (SIGTERM, then SIGKILL after the
grace period; a second signal kills them at once), and the autoscaler exits only when none is left.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from specq.db.migrate import open_migrated
from specq.db.models import Job, Worker
from specq.db.session import Database
from specq.db.states import JobState, WorkerState
from specq.worker.autoscale.config import AutoscaleConfig
from specq.worker.autoscale.policy import Decision, PolicyState, decide
from specq.worker.autoscale.supervisor import Supervisor

log = logging.getLogger(__name__)


def read_backlog(db: Database) -> int:
    """Requests queued or running, over the jobs that have not ended."""
    with db.session() as session:
        remaining = session.scalar(
            select(func.coalesce(func.sum(Job.total - Job.completed - Job.failed), 0)).where(
                Job.state.in_([JobState.QUEUED, JobState.RUNNING])
            )
        )
    return max(0, int(remaining or 0))


def idle_pids(db: Database, pids: list[int]) -> set[int]:
    """Of these local worker processes, the ones whose workers-table row says idle."""
    if not pids:
        return set()
    with db.session() as session:
        rows = session.scalars(
            select(Worker.pid).where(
                Worker.host == socket.gethostname(), Worker.pid.in_(pids), Worker.state == WorkerState.IDLE
            )
        )
        return set(rows)


class Autoscaler:
    def __init__(
        self,
        config: AutoscaleConfig,
        db: Database,
        env: Mapping[str, str],
        log_dir: Path | None = None,
        queue_length: Any = None,  # () -> int | None: the Redis list length, for the log line
    ) -> None:
        self.config, self.db = config, db
        self.supervisor = Supervisor(config, env, log_dir)
        self.state = PolicyState()
        self.wanted = config.min_workers
        self.queue_length = queue_length or (lambda: None)
        self.stop_requested = threading.Event()
        self.signals = 0

    def tick(self) -> Decision | None:
        """One round: reap, read, decide, apply, log. Returns the decision (None: no backlog read)."""
        sup = self.supervisor
        sup.reap()
        running = len(sup.running())
        decision: Decision | None = None
        try:
            backlog: int | None = read_backlog(self.db)
        except SQLAlchemyError as exc:
            backlog = None
            log.warning("cannot read the backlog (%s); keeping %d workers", str(exc).splitlines()[0], self.wanted)
        if backlog is not None:
            decision = decide(self.config, self.state, backlog, running, time.monotonic())
            self.state, self.wanted = decision.state, decision.wanted
        started = stopped = 0
        if self.wanted > running:
            while len(sup.running()) < self.wanted and sup.can_start():
                sup.start()
                started += 1
        elif self.wanted < running:
            try:
                idle = idle_pids(self.db, [w.pid for w in sup.running()])
            except SQLAlchemyError:
                idle = set()
            for worker in sup.pick_to_stop(running - self.wanted, idle):
                sup.stop(worker)
                stopped += 1
        log.info(
            "backlog %s requests (%s chunk messages), wanted %d, running %d -> start %d, stop %d; %d stopping: %s",
            "?" if backlog is None else backlog,
            _or_unknown(self.queue_length),
            self.wanted,
            running,
            started,
            stopped,
            len(sup.stopping()),
            decision.reason if decision else "no backlog read",
        )
        return decision

    def run(self) -> None:
        """Tick every interval until SIGTERM/SIGINT (or `stop_requested`), then stop every worker."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        log.info(
            "autoscaling %d..%d workers on %s; backlog per worker %d, cooldown %.0fs, interval %.1fs",
            self.config.min_workers,
            self.config.max_workers,
            ",".join(self.config.devices),
            self.config.backlog_per_worker,
            self.config.cooldown_s,
            self.config.interval_s,
        )
        try:
            while not self.stop_requested.is_set():
                self.tick()
                self.stop_requested.wait(self.config.interval_s)
        finally:
            count = len(self.supervisor.workers)
            log.info("shutting down: stopping %d workers (a second signal kills them)", count)
            self.supervisor.stop_all(hurry=lambda: self.signals > 1)
            log.info("all workers stopped")
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signals += 1
        self.stop_requested.set()


def _or_unknown(read: Any) -> str:
    try:
        value = read()
    except Exception:
        return "?"
    return "?" if value is None else str(value)


def worker_env(base: Mapping[str, str], database_url: str | None, broker: str) -> dict[str, str]:
    """The workers' environment: this one, with the resolved service URLs (never on a command line)."""
    env = dict(base)
    if database_url:
        env["SPECQ_DATABASE_URL"] = database_url
    env["SPECQ_BROKER_URL"] = broker
    return env


def run_autoscaler(
    config: AutoscaleConfig,
    *,
    database_url: str | None,
    broker: str,
    env: Mapping[str, str],
    log_dir: Path | None = None,
) -> None:
    """`specq autoscale`: check the services, then scale until SIGTERM. Raises ServiceUnavailableError."""
    import redis

    from specq.jobs.services import check_broker
    from specq.masking import register_urls
    from specq.queue import CHUNK_QUEUE_KEY

    register_urls(database_url, broker)
    db = open_migrated(database_url)
    check_broker(broker)
    client = redis.Redis.from_url(broker, socket_connect_timeout=2, socket_timeout=2)
    Autoscaler(
        config, db, worker_env(env, database_url, broker), log_dir, queue_length=lambda: client.llen(CHUNK_QUEUE_KEY)
    ).run()
