"""A background thread per worker: heartbeat into the workers table, renew leases, sweep dead ones.

rq's `StartedJobRegistry.cleanup`, as a thread: every `heartbeat_s` the worker renews the leases it
holds (so they only expire if it dies), and every `sweep_s` it puts back the requests whose lease did
expire and enqueues their chunks again, and enqueues again the chunks whose broker message was lost
(`worker.recovery`). Every worker sweeps; the row locks make each requeue happen once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError
from sqlalchemy import update
from sqlalchemy.exc import SQLAlchemyError

from specq.db.models import Worker
from specq.db.session import identity
from specq.db.states import WorkerState
from specq.db.types import utcnow
from specq.errors import SpecqError
from specq.jobs.retention import prune, retention_from_env
from specq.worker.claims import release_claimed, renew_leases, requeue_expired
from specq.worker.context import WorkerContext
from specq.worker.recovery import lost_chunks
from specq.worker.serving import publish_serving

PRUNE_EVERY_S = 600.0  # retention is in days: a prune every ten minutes per worker is plenty
log = logging.getLogger(__name__)


def register_worker(ctx: WorkerContext) -> None:
    """Insert (or reset) this worker's row, state idle."""
    now = utcnow()
    with ctx.db.session() as session:
        session.merge(
            Worker(
                name=ctx.config.name,
                device=ctx.config.device,
                state=WorkerState.IDLE,
                host=socket.gethostname(),
                pid=os.getpid(),
                started_at=now,
                heartbeat_at=now,
                current_batch=None,
                current_job=None,
            )
        )


def unregister_worker(ctx: WorkerContext) -> None:
    with ctx.db.session() as session:
        session.execute(
            update(Worker)
            .where(Worker.name == ctx.config.name)
            .values(state=WorkerState.STOPPED, current_batch=None, current_job=None, heartbeat_at=utcnow())
            .execution_options(synchronize_session=False)
        )


class Heartbeat:
    def __init__(self, ctx: WorkerContext, broker: str | None, alive_file: str | None = None) -> None:
        self.ctx, self.broker = ctx, broker  # broker None: no sweeping (nothing to enqueue on)
        self.alive_file = Path(alive_file) if alive_file else None  # touched at each beat
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specq-heartbeat", daemon=True)
        self._last_sweep = 0.0
        self._last_prune = 0.0
        self._retention = retention_from_env()  # a bad SPECQ_RETENTION stops the worker before it serves
        self._redis: Any = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        failing_since: float | None = None
        every = self.ctx.config.queue.heartbeat_s
        self._touch_alive_file()
        while not self._stop.wait(every):
            # the thread is alive, whether or not the database answers: an outage is waited out, not
            # answered with restarts
            self._touch_alive_file()
            try:
                self.beat()
            except (SQLAlchemyError, SpecqError, OSError, RedisError) as exc:
                # the database or broker may be back at the next beat; a worker does not die of it.
                # One warning per outage, not one per beat
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("heartbeat failed (retrying every %.1fs): %s", every, reason)
                else:
                    log.debug("heartbeat failed again: %s", reason)
                continue
            if failing_since is not None:
                log.warning("heartbeat back after %.1fs", time.monotonic() - failing_since)
                failing_since = None

    def _touch_alive_file(self) -> None:
        if self.alive_file is None:
            return
        try:
            self.alive_file.touch()
        except OSError as exc:
            log.debug("cannot touch %s: %s", self.alive_file, exc)

    def beat(self) -> None:
        ctx = self.ctx
        holding = ctx.shared.holding  # one read: the task thread replaces it
        with ctx.db.session() as session:
            if holding:
                renew_leases(session, ctx.config.name, ctx.config.queue.lease_s, sorted(holding))
            if ctx.config.registered:
                session.execute(
                    update(Worker)
                    .where(Worker.name == ctx.config.name)
                    .values(heartbeat_at=utcnow())
                    .execution_options(synchronize_session=False)
                )
        if self.broker is not None and ctx.config.registered:
            # the database it serves, for clients on the broker that cannot see this database's workers
            publish_serving(ctx, self._broker_client())
        if ctx.shared.abandoned:
            self.give_back_abandoned()
        if self.broker is not None and time.monotonic() - self._last_sweep >= ctx.config.queue.sweep_s:
            self._last_sweep = time.monotonic()
            self.sweep()

    def give_back_abandoned(self) -> int:
        """Put back in the queue the claims of chunks a database error cut short (their tasks retry,
        perhaps on another worker, which could not claim them while this one held the leases)."""
        from specq.jobs.enqueue import enqueue_chunks

        ctx, shared = self.ctx, self.ctx.shared
        with shared.lock:
            abandoned = dict(shared.abandoned)
            with ctx.db.session() as session:
                released = 0
                for ids in abandoned.values():
                    keep = ids - shared.holding
                    if keep:
                        released += release_claimed(session, sorted(keep), [], ctx.config.name)
                if released and self.broker is not None:  # enqueued before the commit, as the sweeper does
                    enqueue_chunks(self.broker, list(abandoned), identity(ctx.db))
            for chunk in abandoned:
                shared.abandoned.pop(chunk, None)
        if released:
            log.warning("gave back %d requests of %d chunks a database error cut short", released, len(abandoned))
        return released

    def sweep(self) -> int:
        """Requeue requests of dead workers, and chunks the broker lost; returns the number of chunks
        enqueued again."""
        from specq.jobs.enqueue import enqueue_chunks
        from specq.jobs.expiry import expire_due_jobs

        assert self.broker is not None
        for job_id in expire_due_jobs(self.ctx.db):
            log.warning("job %s expired: its completion window ended", job_id)
        if time.monotonic() - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = time.monotonic()
            jobs, workers = prune(self.ctx.db, self._retention)
            if jobs or workers:
                log.info("retention: deleted %d ended jobs and %d silent workers' rows", jobs, workers)
        with self.ctx.db.session() as session:
            chunks = requeue_expired(session)
            if chunks:
                # before the commit: if the broker fails, the leases stay expired for the next sweep
                enqueue_chunks(self.broker, chunks, identity(self.ctx.db))
                log.warning("requeued %d chunks whose worker stopped answering", len(chunks))
        with self.ctx.db.session() as session:
            lost = lost_chunks(session, self._broker_client(), self.ctx.config.queue.lost_after)
            if lost:
                enqueue_chunks(self.broker, lost, identity(self.ctx.db))
                log.warning("enqueued %d chunks again whose message the broker lost", len(lost))
        return len(chunks) + len(lost)

    def _broker_client(self) -> Any:
        if self._redis is None:
            import redis

            assert self.broker is not None
            self._redis = redis.Redis.from_url(self.broker, socket_connect_timeout=5, socket_timeout=10)
        return self._redis
