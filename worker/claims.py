"""Atomic claims with a lease, their renewal, and the sweeper that frees the leases of dead workers.

A claim is one guarded `UPDATE ... RETURNING`: on PostgreSQL a concurrent claimer blocks on each row
and re-checks the guard once the first commits, so it skips what was taken; SQLite runs one writer at
a time. Either way a request is claimed by one worker at a time (rq's StartedJobRegistry, as SQL).

Two counters per request: `attempts` counts claims, `starts` the workers that died while running it. A
start is counted just before a worker hands the request to the engine (a batch at a time, so a worker
that dies leaves it counted) and taken back when that worker ends the request itself, alive: with a
failed result or cancelled (`take_back_starts`), so cancel and retry, or an engine error and retry,
spend nothing. A completed request never runs again, so its start is left counted.

A request whose lease expired was in the hands of a worker that died; if it was also started, it is a
*suspect* (it may be what killed the worker). Suspects are isolated by bisection (`suspect_groups`):

- the suspects that died in a fresh batch run again in two halves;
- a suspect group of m that kills its worker again has its started members marked with `start_group =
  m` (and one more start): they run next in groups of ceil(m / 2), while the group's members that
  never started keep their older, larger group size and run together;
- a group that completes is done; so one poisonous prompt among n suspects costs about log2(n) deaths
  and 2 log2(n) batches, not n single-row runs.

A suspect is failed instead of run again (`exhausted`) once it has killed `max_attempts` workers, the
last of them alone (`start_group == 1`: it, and nothing else, was running), or killed so many that no
bisection explains it (`max_attempts` plus the bits of the chunk size), so nothing loops for ever.
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
    starts: int = 0  # workers that died while running it, before this claim
    start_group: int = 0  # the size of the suspect group its last start ran in; 0: a fresh batch

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
            Request.start_group,
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


def cancel_claimed(
    session: Session, job_id: str, request_ids: Sequence[int], owner: str, started: Sequence[int] = ()
) -> int:
    """Give up requests this worker still holds because their job was cancelled; returns how many.
    `started`: those of them this worker counted started; the worker is alive, so those starts are taken
    back either way (a retry must not find them suspects).

    The worker saw the cancel at one of its writes; under the job's row lock it checks the job is still
    cancelled. If it was retried since, the requests are left as they are (a request cancelled under a
    job that runs again would never end, and neither would the job): their leases run out and a sweeper
    queues them again."""
    if not request_ids:
        return 0
    job = lock_job(session, job_id)
    take_back_starts(session, started, owner)
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


def mark_started(session: Session, request_ids: Sequence[int], owner: str, group: int = 0) -> None:
    """Count one more start for requests `owner` is about to hand to the engine, in a suspect group of
    `group` requests (0: a fresh batch)."""
    session.execute(
        update(Request)
        .where(Request.id.in_(request_ids), Request.lease_owner == owner)
        .values(starts=Request.starts + 1, start_group=group)
        .execution_options(synchronize_session=False)
    )


def take_back_starts(session: Session, request_ids: Sequence[int], owner: str) -> None:
    """Take back the start `owner` counted for requests it ends alive (failed or cancelled): it did not
    die running them. Only while it still holds them: a request whose lease another worker took is not
    this worker's to change."""
    if not request_ids:
        return
    session.execute(
        update(Request)
        .where(
            Request.id.in_(request_ids),
            Request.state == RequestState.RUNNING,
            Request.lease_owner == owner,
            Request.starts > 0,
        )
        .values(starts=Request.starts - 1, start_group=0)
        .execution_options(synchronize_session=False)
    )


def exhausted(starts: int, start_group: int, max_attempts: int, chunk_size: int) -> bool:
    """Whether a suspect has killed enough workers to be failed rather than run again: `max_attempts`,
    the last one alone; or more than bisection can take to isolate it (see the module docstring)."""
    if starts < max_attempts:
        return False
    return start_group == 1 or starts >= max_attempts + max(1, chunk_size).bit_length()


def suspect_groups(suspects: Sequence[ClaimedRequest]) -> list[list[ClaimedRequest]]:
    """The suspects in the groups they run in next, least suspicious first (bisection: see the module
    docstring). Suspects that share a start count and a group size died together, or were left together
    untried: those of a fresh batch (group size 0) split in halves, those of a suspect group of m in
    groups of ceil(m / 2)."""
    together: dict[tuple[int, int], list[ClaimedRequest]] = {}
    for request in sorted(suspects, key=lambda r: (r.starts, r.start_group, r.seq)):
        together.setdefault((request.starts, request.start_group), []).append(request)
    groups = []
    for (_, died_in), members in together.items():
        size = -(-(died_in or len(members)) // 2)  # ceil(half)
        groups += [members[i : i + size] for i in range(0, len(members), size)]
    return groups


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

    A request that has killed too many workers (`exhausted`) is failed instead, with the reason, in the
    same transaction (its job may end with it). A request of a job that was cancelled (or expired)
    meanwhile ends as its job did, `cancelled` (or `expired`), never queued: nothing claims under such a
    job, and `retry` requeues exactly those. Chunks are (job_id, first, end) as `jobs.enqueue` sends
    them; the caller enqueues them before it commits, so a failed enqueue leaves the leases expired for
    the next sweep.
    """
    expired = session.execute(
        select(Request.id, Request.job_id, Request.seq, Request.starts, Request.start_group, Request.lease_owner)
        .where(Request.state == RequestState.RUNNING, Request.lease_expires_at < utcnow())
        .order_by(Request.id)
        .with_for_update(skip_locked=True)
    ).all()
    if not expired:
        return []
    jobs = {
        job_id: (JobSettings.from_stored(settings), state)
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
    spent: dict[str, list[GenerationResult]] = {}
    for row in expired:
        if row.id not in requeued:
            continue
        settings = jobs[row.job_id][0]
        if exhausted(row.starts, row.start_group, settings.max_attempts, settings.chunk_size):
            spent.setdefault(row.job_id, []).append(exhausted_result(row.id, row.starts, row.lease_owner))
        else:
            seqs.setdefault(row.job_id, set()).add(row.seq)
    for job_id, failures in spent.items():
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
