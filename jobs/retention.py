"""Retention: ended jobs older than `SPECQ_RETENTION` (a duration, e.g. `30d`; unset: kept until
`specq delete`) are deleted with their requests and results, and the rows of workers that stopped
(or stopped answering) more than a week ago are pruned. The workers' sweepers apply it.

A job goes by the rule of `specq delete` (`jobs.control.delete_job`, under the job's row lock): never
while a request of it runs under a live lease (an expired or cancelled job's workers still finish what
they held; their results would have nowhere to go). Retention has a floor of an hour: a shorter one
(`1s`) would delete every job as it ends, before anyone exports it, so it is refused unless
SPECQ_RETENTION_BELOW_FLOOR=1 says it is meant.
"""

from __future__ import annotations

import os
from datetime import timedelta

from sqlalchemy import delete, select

from specq.db.models import Job, Worker
from specq.db.session import Database
from specq.db.states import JOB_TERMINAL
from specq.db.types import utcnow
from specq.durations import parse_duration
from specq.errors import ConfigError, JobActiveError, JobNotFoundError
from specq.jobs.control import delete_job

WORKER_ROWS_KEPT = timedelta(days=7)  # long enough to read what a crashed fleet looked like
RETENTION_FLOOR = timedelta(hours=1)
RETENTION_ENV = "SPECQ_RETENTION"
BELOW_FLOOR_ENV = "SPECQ_RETENTION_BELOW_FLOOR"


def retention_from_env() -> timedelta | None:
    text = os.environ.get(RETENTION_ENV, "").strip()
    if not text:
        return None
    try:
        retention = parse_duration(text)
    except ValueError as exc:
        raise ConfigError(f"{RETENTION_ENV}: {exc}") from None
    if retention < RETENTION_FLOOR and os.environ.get(BELOW_FLOOR_ENV, "").strip() != "1":
        raise ConfigError(
            f"{RETENTION_ENV}: {text!r} is under the floor of 1h (jobs would be deleted as they end); "
            f"set {BELOW_FLOOR_ENV}=1 if that is meant"
        )
    return retention


def prune(db: Database, retention: timedelta | None) -> tuple[int, int]:
    """Delete ended jobs that finished more than `retention` ago (None: none) and nothing runs of, and
    worker rows silent for a week; (jobs deleted, worker rows deleted). Each job is deleted as `specq
    delete` deletes it; one still finishing requests is left for a later prune."""
    now = utcnow()
    jobs = 0
    if retention is not None:
        with db.session() as session:
            due = session.scalars(
                select(Job.id).where(Job.state.in_([str(s) for s in JOB_TERMINAL]), Job.finished_at < now - retention)
            ).all()
        for job_id in due:
            try:
                delete_job(db, job_id)
            except (JobActiveError, JobNotFoundError):  # retried, still finishing, or deleted meanwhile
                continue
            jobs += 1
    with db.session() as session:
        workers = session.execute(
            delete(Worker)
            .where(Worker.heartbeat_at < now - WORKER_ROWS_KEPT)
            .execution_options(synchronize_session=False)
        ).rowcount  # type: ignore[attr-defined]
    return jobs, workers
