"""`specq cancel`, `specq retry` and `specq delete`: state changes guarded by the transition table, each in one
transaction that holds the job's row lock (`db.locks`): they are atomic against each other and against
workers claiming, storing and settling, which take the same lock first."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from sqlalchemy import and_, delete, func, or_, select, update
from sqlalchemy.orm import Session

from specq.db.locks import lock_job
from specq.db.models import Job, Request, Result
from specq.db.session import Database, schema_ready
from specq.db.states import JOB_TERMINAL, JobState, RequestState, job_sources, request_sources
from specq.db.types import utcnow
from specq.errors import JobActiveError, JobNotFoundError
from specq.jobs.settings import JobSettings
from specq.queue import Chunk


@dataclass(frozen=True)
class CancelOutcome:
    previous: str  # the job's state before
    cancelled: int  # queued requests, cancelled now: they will not run
    changed: bool  # False: the job had already ended
    # requests that workers held (claimed, in or waiting for their engine): each worker sees the cancel at
    # the next result it stores, keeps the results stored by then, and cancels the rest of what it holds
    running: int = 0


@dataclass(frozen=True)
class RetryOutcome:
    previous: str  # the job's state before
    state: str  # ... and after
    requeued: dict[str, int]  # requests put back in the queue, by the state they were in
    chunks: list[Chunk]  # to enqueue: every chunk holding a queued request of the job
    device: str | None  # the device the job was submitted with, for a retry in-process
    # a cancelled job's requests that still run under a live lease (their workers give them up at their
    # next write): while there are any, retry changes nothing
    winding_down: int = 0


def _locked_job(db: Database, session: Session, job_id: str) -> Job:
    if not schema_ready(db):  # an empty database holds no job
        raise JobNotFoundError(f"no job has the id {job_id!r}")
    job = lock_job(session, job_id)
    if job is None:
        raise JobNotFoundError(f"no job has the id {job_id!r}")
    return job


def _still_running(session: Session, job_id: str) -> int:
    """The job's requests a worker still holds under a live lease (a cancelled job's are winding down)."""
    return int(
        session.scalar(
            select(func.count()).where(
                Request.job_id == job_id,
                Request.state == RequestState.RUNNING,
                Request.lease_expires_at >= utcnow(),
            )
        )
        or 0
    )


def cancel_job(db: Database, job_id: str) -> CancelOutcome:
    """Stop a job: its queued requests are cancelled now; the requests workers hold end too, cancelled,
    when each worker sees the cancel at the next result it stores (those stored by then are kept). A job
    that has ended is left as it is."""
    with db.session() as session:
        job = _locked_job(db, session, job_id)
        previous = job.state
        if job.state not in job_sources(JobState.CANCELLED):
            return CancelOutcome(previous, 0, changed=False)
        job.state, job.finished_at = JobState.CANCELLED, utcnow()
        cancelled = session.execute(
            update(Request)
            .where(Request.job_id == job_id, Request.state == RequestState.QUEUED)
            .values(state=RequestState.CANCELLED)
            .execution_options(synchronize_session=False)
        ).rowcount  # type: ignore[attr-defined]
        running = session.scalar(
            select(func.count()).where(Request.job_id == job_id, Request.state == RequestState.RUNNING)
        )
        return CancelOutcome(previous, cancelled, changed=True, running=int(running or 0))


def retry_job(db: Database, job_id: str, enqueued: bool = False) -> RetryOutcome:
    """Requeue the job's failed and cancelled requests (and running ones whose lease expired); the
    failed ones' results are deleted, and a job that had ended (a cancelled one included) is queued again.

    Right after `cancel`, the requests that were running still hold their leases until their workers
    see the cancel and give them up (as cancelled): until then a retry of the cancelled job changes
    nothing and says so (`winding_down`), since a request given up under a job that runs again would
    never end, and neither would the job.

    The chunks returned cover every queued request of an ended job (and of any job run in-process), so
    a retry also recovers requests whose task was lost (e.g. a broker that was flushed); of a job still
    under way on a broker, only the chunks of what this retry requeued (a second retry sends none).
    `enqueued`: the caller sends them to the broker (the job's `enqueued_at` is set, so sweepers watch
    its messages), else it runs them in-process.
    """
    with db.session() as session:
        job = _locked_job(db, session, job_id)
        previous, settings = job.state, JobSettings.from_stored(job.settings)
        if job.state == JobState.CANCELLED:
            winding_down = _still_running(session, job_id)
            if winding_down:
                return RetryOutcome(previous, previous, {}, [], settings.device, winding_down)
        if job.state == JobState.EXPIRED:
            job.expires_at = None  # a retried job has no window: it would expire again at once
        retryable = [s for s in request_sources(RequestState.QUEUED) if s != RequestState.RUNNING]
        found = session.execute(
            select(Request.id, Request.state).where(
                Request.job_id == job_id,
                or_(
                    Request.state.in_(retryable),  # failed, cancelled
                    # abandoned: an in-process run that was killed (no sweeper without a broker)
                    and_(Request.state == RequestState.RUNNING, Request.lease_expires_at < utcnow()),
                ),
            )
        ).all()
        ids = [request_id for request_id, _ in found]
        requeued = Counter(str(state) for _, state in found)
        if ids:
            n_failed = session.execute(
                delete(Result).where(Result.request_id.in_(ids)).execution_options(synchronize_session=False)
            ).rowcount  # type: ignore[attr-defined]
            session.execute(
                update(Request)
                .where(Request.id.in_(ids))
                .values(state=RequestState.QUEUED, lease_owner=None, lease_expires_at=None)
                .execution_options(synchronize_session=False)
            )
            # a failed request counted in `failed` and generated no tokens
            job.failed -= n_failed
        size = settings.chunk_size
        queued = select(Request.seq // size).where(Request.job_id == job_id, Request.state == RequestState.QUEUED)
        if enqueued and job.state not in JOB_TERMINAL:
            # a job still under way has its other queued requests' chunks on the broker already (a lost one
            # is the sweepers' to find): only what this retry requeued is enqueued, so a repeated retry
            # sends nothing twice
            queued = queued.where(Request.id.in_(ids))
        firsts = session.scalars(queued.distinct()).all()
        # queued requests under an ended job (a sweeper of an older version requeued them under a cancelled
        # job) run again with it too
        if firsts and job.state in job_sources(JobState.QUEUED):
            job.state, job.finished_at = JobState.QUEUED, None
        job.enqueued_at = utcnow() if enqueued else None
        chunks = [(job_id, int(i) * size, min((int(i) + 1) * size, job.total)) for i in sorted(firsts)]
        return RetryOutcome(previous, job.state, dict(requeued), chunks, settings.device)


def delete_job(db: Database, job_id: str) -> int:
    """Delete the job with its requests, results and batches, in one transaction; returns how many
    requests went with it. Refused (JobActiveError) while it is queued or running, and while a
    cancelled job's workers still finish requests they held (they would write to rows that are gone).

    The database cascades the delete (ON DELETE CASCADE; SQLite's foreign keys are on). Chunks of the
    job still on the broker find no job and are dropped by the worker that takes them."""
    with db.session() as session:
        job = _locked_job(db, session, job_id)
        if job.state not in JOB_TERMINAL:
            raise JobActiveError(f"job {job_id} is {job.state}: cancel it first (`specq cancel {job_id}`)")
        finishing = _still_running(session, job_id)
        if finishing:
            raise JobActiveError(
                f"job {job_id} is {job.state}, but {finishing} requests are still finishing: try again shortly"
            )
        requests = job.total
        session.execute(delete(Job).where(Job.id == job_id).execution_options(synchronize_session=False))
        return requests
