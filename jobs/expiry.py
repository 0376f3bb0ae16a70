"""Completion windows (OpenAI Batch's `completion_window`): a job not done by its `expires_at` ends as
`expired`. Its requests not started by then are expired; those running finish and keep their results.

Applied under the job's row lock (`db.locks`), so it is atomic against claims, stores, cancel and
retry: by a worker before it claims a chunk, by the workers' sweepers for jobs no worker claims, and by
`submit --wait` while it polls (a job with no worker at all still ends on time for its waiter).
"""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from specq.db.locks import lock_job
from specq.db.models import Job, Request
from specq.db.session import Database
from specq.db.states import JobState, RequestState, job_sources
from specq.db.types import utcnow


def expire_if_due(session: Session, job: Job) -> bool:
    """End `job` (its row locked by the caller) as expired if its window has passed; True if it did.
    An expired job's queued requests (given back by a worker that stopped after the window ended) are
    expired too: nobody would claim them."""
    now = utcnow()
    due = job.expires_at is not None and job.expires_at <= now and job.state in job_sources(JobState.EXPIRED)
    if due:
        job.state, job.finished_at = JobState.EXPIRED, now
    elif job.state != JobState.EXPIRED:
        return False
    session.execute(
        update(Request)
        .where(Request.job_id == job.id, Request.state == RequestState.QUEUED)
        .values(state=RequestState.EXPIRED)
        .execution_options(synchronize_session=False)
    )
    return due


def expire_due_jobs(db: Database, job_id: str | None = None) -> list[str]:
    """Expire every job whose window has passed (only `job_id`, if given); the ids expired."""
    query = select(Job.id).where(
        Job.expires_at.is_not(None), Job.expires_at <= utcnow(), Job.state.in_(job_sources(JobState.EXPIRED))
    )
    if job_id is not None:
        query = query.where(Job.id == job_id)
    with db.session() as session:
        due = list(session.scalars(query))
    expired = []
    for due_id in due:
        with db.session() as session:
            job = lock_job(session, due_id)
            if job is not None and expire_if_due(session, job):
                expired.append(due_id)
    return expired
