"""A background thread per worker: heartbeat into the workers table, renew leases, sweep dead ones.

rq's `StartedJobRegistry.cleanup`, as a thread: every `heartbeat_s` the worker renews the leases it
holds (so they only expire if it dies), and every `sweep_s` it puts back the requests whose lease did
expire and enqueues their chunks again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from sqlalchemy import update
from sqlalchemy.exc import SQLAlchemyError

from db.models import Worker
from db.states import WorkerState
from db.types import utcnow
from specq.errors import SpecqError
from worker.chunk import WorkerContext
from worker.claims import renew_leases, requeue_expired

log = logging.getLogger(__name__)


def register_worker(ctx: WorkerContext) -> None:
    """Insert (or reset) this worker's row, state idle."""
    now = utcnow()
    with ctx.db.session() as session:
        session.merge(
            Worker(
                name=ctx.name,
                device=ctx.device,
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
            .where(Worker.name == ctx.name)
            .values(state=WorkerState.STOPPED, current_batch=None, current_job=None, heartbeat_at=utcnow())
            .execution_options(synchronize_session=False)
        )


class Heartbeat:
    def __init__(self, ctx: WorkerContext, broker: str | None) -> None:
        self.ctx, self.broker = ctx, broker  # broker None: no sweeping (nothing to enqueue on)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specq-heartbeat", daemon=True)
        self._last_sweep = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.ctx.queue.heartbeat_s):
            try:
                self.beat()
            except (SQLAlchemyError, SpecqError, OSError) as exc:
                # the database or broker may be back at the next beat; a worker does not die of it
                log.warning("heartbeat failed: %s", exc)

    def beat(self) -> None:
        ctx = self.ctx
        with ctx.db.session() as session:
            renew_leases(session, ctx.name, ctx.queue.lease_s)
            if ctx.registered:
                session.execute(
                    update(Worker)
                    .where(Worker.name == ctx.name)
                    .values(heartbeat_at=utcnow())
                    .execution_options(synchronize_session=False)
                )
        if self.broker is not None and time.monotonic() - self._last_sweep >= ctx.queue.sweep_s:
            self._last_sweep = time.monotonic()
            self.sweep()

    def sweep(self) -> int:
        """Requeue requests of dead workers; returns the number of chunks enqueued again."""
        from jobs.enqueue import enqueue_chunks

        assert self.broker is not None
        with self.ctx.db.session() as session:
            chunks = requeue_expired(session)
            if chunks:
                # before the commit: if the broker fails, the leases stay expired for the next sweep
                enqueue_chunks(self.broker, chunks)
                log.warning("requeued %d chunks whose worker stopped answering", len(chunks))
        return len(chunks)
