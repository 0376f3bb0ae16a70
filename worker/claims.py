"""Atomic claims with a lease, their renewal, and the sweeper that frees the leases of dead workers.

A claim is one guarded `UPDATE ... RETURNING`: on PostgreSQL a concurrent claimer blocks on each row
and re-checks the guard once the first commits, so it skips what was taken; SQLite runs one writer at
a time. Either way a request is claimed by one worker at a time (rq's StartedJobRegistry, as SQL).

Two counters per request: `attempts` counts claims, `starts` the times a worker handed it to the engine
(marked just before, a batch at a time). A request whose lease expired was in the hands of a worker that
died; if it was also started, it is a *suspect* (it may be what killed the worker): it runs alone next
time, and once its starts reach the job's `max_attempts` it is failed with that reason instead of run
again, so one poisonous prompt costs a few worker restarts, never the job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from specq.db.locks import lock_job
from specq.db.models import Job, Request
from specq.db.states import NOT_CLAIMABLE, JobState, RequestState, job_sources, request_sources
from specq.db.types import utcnow
from specq.decoding.types import GenerationResult
from specq.jobs.settings import JobSettings
from specq.queue import Chunk
from specq.worker.results import store_results


@dataclass(frozen=True)
class ClaimedRequest:
    id: int
    seq: int
    custom_id: str
    kind: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    overrides: dict[str, Any]
    prompt_token_ids: list[int] | None
    starts: int = 0  # times a worker handed it to the engine before this claim

    @property
    def suspect(self) -> bool:
        """Started before by a worker that never stored its result: it may be what killed that worker."""
        return self.starts > 0


def claim_chunk(
    session: Session, job_id: str, first: int, end: int, owner: str, lease_s: float
) -> list[ClaimedRequest]:
    """Claim the chunk's claimable requests (seq in [first, end)) for `owner`.

    Claimable: queued, or running under a lease that expired (its worker died) or that `owner` itself
    holds (this worker runs one chunk at a time, so a lease of its own is left from a run that died,
    e.g. a task redelivered after a crash of the process it ran in).

    Under the job's row lock (`db.locks`): a job that is gone, cancelled or expired has nothing to claim.
    """
    job = lock_job(session, job_id)
    if job is None or job.state in NOT_CLAIMABLE:
        return []
    now = utcnow()
    stmt = (
        update(Request)
        .where(
            Request.job_id == job_id,
            Request.seq >= first,
            Request.seq < end,
            or_(
                Request.state == RequestState.QUEUED,
                and_(
                    Request.state == RequestState.RUNNING,
                    or_(Request.lease_expires_at < now, Request.lease_owner == owner),
                ),
            ),
        )
        .values(
            state=RequestState.RUNNING,
            lease_owner=owner,
            lease_expires_at=now + timedelta(seconds=lease_s),
            attempts=Request.attempts + 1,
        )
        .returning(
            Request.id,
            Request.seq,
            Request.custom_id,
            Request.kind,
            Request.prompt,
            Request.messages,
            Request.overrides,
            Request.prompt_token_ids,
            Request.starts,
        )
        .execution_options(synchronize_session=False)
    )
    claimed = sorted((ClaimedRequest(*row) for row in session.execute(stmt)), key=lambda c: c.seq)
    if claimed:
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.state.in_(job_sources(JobState.RUNNING)))
            .values(state=JobState.RUNNING, started_at=func.coalesce(Job.started_at, now))
            .execution_options(synchronize_session=False)
        )
    return claimed


def renew_leases(session: Session, owner: str, lease_s: float, request_ids: Sequence[int] | None = None) -> int:
    """Push back the expiry of the leases `owner` holds (of `request_ids` only, when given); returns how many.

    A worker renews only the requests of the chunk in its hands: a chunk whose task was cut short (the
    database went away, the task is retried, perhaps elsewhere) must see its leases expire."""
    condition = [Request.state == RequestState.RUNNING, Request.lease_owner == owner]
    if request_ids is not None:
        condition.append(Request.id.in_(request_ids))
    stmt = (
        update(Request)
        .where(*condition)
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
        .execution_options(synchronize_session=False)
    )
    return session.execute(stmt).rowcount  # type: ignore[attr-defined]


def cancel_claimed(session: Session, job_id: str, request_ids: Sequence[int], owner: str) -> int:
    """Give up requests this worker still holds because their job was cancelled; returns how many.

    The worker saw the cancel at one of its writes; under the job's row lock it checks the job is still
    cancelled. If it was retried since, the requests are left as they are (a request cancelled under a
    job that runs again would never end, and neither would the job): their leases run out and a sweeper
    queues them again."""
    if not request_ids:
        return 0
    job = lock_job(session, job_id)
    if job is None or job.state != JobState.CANCELLED:
        return 0
    stmt = (
        update(Request)
        .where(
            Request.id.in_(request_ids),
            Request.state.in_(request_sources(RequestState.CANCELLED)),
            Request.lease_owner == owner,
        )
        .values(state=RequestState.CANCELLED, lease_owner=None, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )
    return session.execute(stmt).rowcount  # type: ignore[attr-defined]


def mark_started(session: Session, request_ids: Sequence[int], owner: str) -> None:
    """Count one more start for requests `owner` is about to hand to the engine."""
    session.execute(
        update(Request)
        .where(Request.id.in_(request_ids), Request.lease_owner == owner)
        .values(starts=Request.starts + 1)
        .execution_options(synchronize_session=False)
    )


def release_claimed(session: Session, request_ids: Sequence[int], unstarted: Sequence[int], owner: str) -> int:
    """Give back requests this worker holds but will not run (it is shutting down, or a database error
    cut their chunk short): queued again at once, rather than when the lease expires. `unstarted` were
    marked started but never handed to the engine, so that start is taken back."""
    if not request_ids:
        return 0
    if unstarted:
        session.execute(
            update(Request)
            .where(Request.id.in_(unstarted), Request.lease_owner == owner, Request.starts > 0)
            .values(starts=Request.starts - 1)
            .execution_options(synchronize_session=False)
        )
    stmt = (
        update(Request)
        .where(Request.id.in_(request_ids), Request.state == RequestState.RUNNING, Request.lease_owner == owner)
        .values(state=RequestState.QUEUED, lease_owner=None, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )
    return session.execute(stmt).rowcount  # type: ignore[attr-defined]


def exhausted_error(starts: int, owner: str | None) -> str:
    last = f" (last: {owner})" if owner else ""
    return (
        f"gave up after {starts} attempts: the worker running this request stopped each time before it "
        f"finished{last}; it may crash the worker (out of host memory, a fault in a kernel)"
    )


def exhausted_result(request_id: int, starts: int, owner: str | None) -> GenerationResult:
    return GenerationResult.failed(request_id, exhausted_error(starts, owner))


def requeue_expired(session: Session) -> list[Chunk]:
    """Put requests whose lease expired back in the queue; returns the chunks to enqueue again.

    A request whose starts reached its job's `max_attempts` is failed instead, with the reason, in the
    same transaction (its job may end with it). A request of a job that was cancelled (or expired)
    meanwhile ends as its job did, `cancelled` (or `expired`), never queued: nothing claims under such a
    job, and `retry` requeues exactly those. Chunks are (job_id, first, end) as `jobs.enqueue` sends
    them; the caller enqueues them before it commits, so a failed enqueue leaves the leases expired for
    the next sweep.
    """
    expired = session.execute(
        select(Request.id, Request.job_id, Request.seq, Request.starts, Request.lease_owner)
        .where(Request.state == RequestState.RUNNING, Request.lease_expires_at < utcnow())
        .order_by(Request.id)
        .with_for_update(skip_locked=True)
    ).all()
    if not expired:
        return []
    jobs = {
        job_id: (JobSettings.from_stored(settings).max_attempts, state)
        for job_id, settings, state in session.execute(
            select(Job.id, Job.settings, Job.state).where(Job.id.in_({row.job_id for row in expired}))
        )
    }
    # the request's next state: as its job ended, else queued
    ends_as = {JobState.CANCELLED: RequestState.CANCELLED, JobState.EXPIRED: RequestState.EXPIRED}
    by_state: dict[RequestState, list[int]] = {}
    for row in expired:
        by_state.setdefault(ends_as.get(jobs[row.job_id][1], RequestState.QUEUED), []).append(row.id)
    requeued = set(by_state.get(RequestState.QUEUED, []))
    for state, ids in by_state.items():
        if ids:
            session.execute(
                update(Request)
                .where(Request.id.in_(ids))
                .values(state=state, lease_owner=None, lease_expires_at=None)
                .execution_options(synchronize_session=False)
            )
    seqs: dict[str, set[int]] = {}
    exhausted: dict[str, list[GenerationResult]] = {}
    for row in expired:
        if row.id not in requeued:
            continue
        if row.starts >= jobs[row.job_id][0]:
            exhausted.setdefault(row.job_id, []).append(exhausted_result(row.id, row.starts, row.lease_owner))
        else:
            seqs.setdefault(row.job_id, set()).add(row.seq)
    for job_id, failures in exhausted.items():
        store_results(session, job_id, failures, "sweeper")
    return chunks_of(session, seqs)


def chunks_of(session: Session, seqs: dict[str, set[int]]) -> list[Chunk]:
    """The distinct chunks, (job_id, first, end), that hold the given request positions of each job."""
    if not seqs:
        return []
    jobs = {
        job_id: (JobSettings.from_stored(settings).chunk_size, total)
        for job_id, settings, total in session.execute(select(Job.id, Job.settings, Job.total).where(Job.id.in_(seqs)))
    }
    chunks = []
    for job_id, positions in seqs.items():
        size, total = jobs[job_id]
        for index in sorted({seq // size for seq in positions}):
            chunks.append((job_id, index * size, min((index + 1) * size, total)))
    return chunks
