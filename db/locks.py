"""The job row lock: the one order in which job-state changes take their locks.

Every transaction that moves a job's state, or moves its requests because of that state (`cancel`,
`retry`, a worker's claim, a stored result, a worker settling a chunk after a cancel), first takes the
job's row with `SELECT ... FOR UPDATE` and checks the state under that lock. So they run one after the
other, none acts on a state another has just changed, and all lock in the same order (the job, then
its requests), so none deadlocks another. SQLite has one writer at a time and ignores the clause.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from specq.db.models import Job


def lock_job(session: Session, job_id: str) -> Job | None:
    """The job, its row locked until the transaction ends; None if there is no such job."""
    return session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one_or_none()
