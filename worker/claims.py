"""Atomic claims with a lease, their renewal, and the sweeper that frees the leases of dead workers.

A claim is one guarded `UPDATE ... RETURNING`: on PostgreSQL a concurrent claimer blocks on each row
and re-checks the guard once the first commits, so it skips what was taken; SQLite runs one writer at
a time. Either way a request is claimed by one worker at a time (rq's StartedJobRegistry, as SQL).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from db.models import Job, Request
from db.states import JobState, RequestState, job_sources, request_sources
from db.types import utcnow


@dataclass(frozen=True)
class ClaimedRequest:
    id: int
    seq: int
    custom_id: str
    kind: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    overrides: dict[str, Any]


def claim_chunk(
    session: Session, job_id: str, first: int, end: int, owner: str, lease_s: float
) -> list[ClaimedRequest]:
    """Claim the chunk's claimable requests (seq in [first, end)) for `owner`.

    Claimable: queued, or running under a lease that expired (its worker died) or that `owner` itself
    holds (this worker runs one chunk at a time, so a lease of its own is left from a run that died,
    e.g. a task redelivered after a crash of the process it ran in).
    """
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
        )
        .execution_options(synchronize_session=False)
    )
    claimed = [ClaimedRequest(*row) for row in session.execute(stmt)]
    if claimed:
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.state.in_(job_sources(JobState.RUNNING)))
            .values(state=JobState.RUNNING, started_at=func.coalesce(Job.started_at, now))
            .execution_options(synchronize_session=False)
        )
    return claimed


def renew_leases(session: Session, owner: str, lease_s: float) -> int:
    """Push back the expiry of every lease `owner` holds; returns how many."""
    stmt = (
        update(Request)
        .where(Request.state == RequestState.RUNNING, Request.lease_owner == owner)
        .values(lease_expires_at=utcnow() + timedelta(seconds=lease_s))
        .execution_options(synchronize_session=False)
    )
    return session.execute(stmt).rowcount  # type: ignore[attr-defined]


def cancel_claimed(session: Session, request_ids: Sequence[int], owner: str) -> int:
    """Give up requests this worker still holds because their job was cancelled."""
    if not request_ids:
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


def requeue_expired(session: Session) -> list[tuple[str, int, int]]:
    """Put requests whose lease expired back in the queue; returns the chunks to enqueue again.

    Chunks are (job_id, first, end) as `jobs.enqueue` sends them; the caller enqueues them before it
    commits, so a failed enqueue leaves the leases expired for the next sweep.
    """
    stmt = (
        update(Request)
        .where(Request.state == RequestState.RUNNING, Request.lease_expires_at < utcnow())
        .values(state=RequestState.QUEUED, lease_owner=None, lease_expires_at=None)
        .returning(Request.job_id, Request.seq)
        .execution_options(synchronize_session=False)
    )
    seqs: dict[str, set[int]] = {}
    for job_id, seq in session.execute(stmt):
        seqs.setdefault(job_id, set()).add(seq)
    return chunks_of(session, seqs)


def chunks_of(session: Session, seqs: dict[str, set[int]]) -> list[tuple[str, int, int]]:
    """The distinct chunks, (job_id, first, end), that hold the given request positions of each job."""
    if not seqs:
        return []
    jobs = {
        job_id: (settings["chunk_size"], total)
        for job_id, settings, total in session.execute(select(Job.id, Job.settings, Job.total).where(Job.id.in_(seqs)))
    }
    chunks = []
    for job_id, positions in seqs.items():
        size, total = jobs[job_id]
        for index in sorted({seq // size for seq in positions}):
            chunks.append((job_id, index * size, min((index + 1) * size, total)))
    return chunks
