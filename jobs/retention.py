"""Retention: ended jobs older than `SPECQ_RETENTION` (a duration, e.g. `30d`; unset: kept until
`specq delete`) are deleted with their requests and results, and the rows of workers that stopped
(or stopped answering) more than a week ago are pruned. The workers' sweepers apply it."""

from __future__ import annotations

import os
from datetime import timedelta

from sqlalchemy import delete

from specq.db.models import Job, Worker
from specq.db.session import Database
from specq.db.states import JOB_TERMINAL
from specq.db.types import utcnow
from specq.durations import parse_duration
from specq.errors import ConfigError

WORKER_ROWS_KEPT = timedelta(days=7)  # long enough to read what a crashed fleet looked like


def retention_from_env() -> timedelta | None:
    text = os.environ.get("SPECQ_RETENTION", "").strip()
    if not text:
        return None
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise ConfigError(f"SPECQ_RETENTION: {exc}") from None


def prune(db: Database, retention: timedelta | None) -> tuple[int, int]:
    """Delete ended jobs that finished more than `retention` ago (None: none) and worker rows silent for
    a week; (jobs deleted, worker rows deleted). The database cascades each job's delete."""
    now = utcnow()
    jobs = 0
    with db.session() as session:
        if retention is not None:
            jobs = session.execute(
                delete(Job)
                .where(Job.state.in_([str(s) for s in JOB_TERMINAL]), Job.finished_at < now - retention)
                .execution_options(synchronize_session=False)
            ).rowcount  # type: ignore[attr-defined]
        workers = session.execute(
            delete(Worker)
            .where(Worker.heartbeat_at < now - WORKER_ROWS_KEPT)
            .execution_options(synchronize_session=False)
        ).rowcount  # type: ignore[attr-defined]
    return jobs, workers
