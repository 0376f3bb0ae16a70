"""Storing results: idempotent, and the job ends in the transaction that stores its last result.

A result is written with `INSERT ... ON CONFLICT (request_id) DO NOTHING RETURNING`, so a request run
twice (a lease that expired on a slow but living worker) keeps its first result, and only rows that
were really inserted move the job's counters. The job's row is locked first; whoever sees
completed + failed reach total ends the job, guarded by its state. No chord, no coordinator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from specq.db.locks import lock_job
from specq.db.models import Batch, Job, Request, Result
from specq.db.states import JobState, RequestState, job_sources
from specq.db.types import utcnow
from specq.decoding.stats import EngineStats
from specq.decoding.types import GenerationResult


@dataclass(frozen=True)
class StoreOutcome:
    inserted: int  # results really written (not already there)
    job_state: str  # the job's state after this write


def _insert_results(session: Session) -> Any:
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return postgresql.insert(Result).on_conflict_do_nothing(index_elements=["request_id"])
    if dialect == "sqlite":
        return sqlite.insert(Result).on_conflict_do_nothing(index_elements=["request_id"])
    return insert(Result)


def _result_row(result: GenerationResult, worker: str) -> dict[str, Any]:
    failed = result.error is not None
    return {
        "request_id": result.key,
        "status": RequestState.FAILED if failed else RequestState.COMPLETED,
        # PostgreSQL text cannot hold NUL; a model may emit one, so it is stored as U+FFFD
        "completion": None if failed else result.text.replace("\x00", "\ufffd"),
        "token_ids": None if failed else list(result.token_ids),
        "finish_reason": None if failed else result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "draft_tokens": result.draft_tokens,
        "accepted_tokens": result.accepted_tokens,
        "seed": result.seed,
        "latency_s": result.latency_s,
        "error": result.error,
        "logprobs": None if failed or result.logprobs is None else [entry.to_dict() for entry in result.logprobs],
        "worker": worker,
        "created_at": utcnow(),
    }


def store_results(session: Session, job_id: str, results: Sequence[GenerationResult], worker: str) -> StoreOutcome:
    """Write results (keyed by request id), mark their requests ended, count them, maybe end the job.

    The job's row is locked first (`db.locks`), so a cancel or a retry runs wholly before or after."""
    lock_job(session, job_id)
    rows = [_result_row(r, worker) for r in results]
    inserted = set(session.scalars(_insert_results(session).returning(Result.request_id), rows).all())
    fresh = [row for row in rows if row["request_id"] in inserted]
    done = [row["request_id"] for row in fresh if row["status"] == RequestState.COMPLETED]
    failed = [row["request_id"] for row in fresh if row["status"] == RequestState.FAILED]
    for ended, ids in ((RequestState.COMPLETED, done), (RequestState.FAILED, failed)):
        if ids:
            session.execute(
                update(Request)
                .where(Request.id.in_(ids))
                .values(state=ended, lease_owner=None, lease_expires_at=None)
                .execution_options(synchronize_session=False)
            )
    tokens = sum(row["completion_tokens"] for row in fresh if row["status"] == RequestState.COMPLETED)
    total, completed, n_failed, state = session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(
            completed=Job.completed + len(done),
            failed=Job.failed + len(failed),
            generated_tokens=Job.generated_tokens + tokens,
        )
        .returning(Job.total, Job.completed, Job.failed, Job.state)
        .execution_options(synchronize_session=False)
    ).one()
    if completed + n_failed >= total and state == JobState.RUNNING:
        final = JobState.COMPLETED if completed else JobState.FAILED
        session.execute(
            update(Job)
            .where(Job.id == job_id, Job.state.in_(job_sources(final)))
            .values(state=final, finished_at=utcnow())
            .execution_options(synchronize_session=False)
        )
        state = final
    return StoreOutcome(len(fresh), state)


def start_batch(session: Session, job_id: str, worker: str, device: str, size: int) -> int:
    batch = Batch(job_id=job_id, worker=worker, device=device, size=size, started_at=utcnow())
    session.add(batch)
    session.flush()
    return batch.id


def _draft_counters(stats: EngineStats) -> dict[str, Any]:
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "accepted_per_position": list(stats.accepted_per_position),
        "by_proposer": {name: dict(counters) for name, counters in stats.by_proposer.items()},
    }


def record_batch_progress(session: Session, batch_id: int, stats: EngineStats) -> None:
    """The running batch's draft counters so far, written with each of its results: `status` and the
    progress of `submit --wait` and `specq wait` show the acceptance while the batch runs, not only at
    its end. The batch's other counters, and `ended_at`, come with `end_batch`."""
    session.execute(
        update(Batch)
        .where(Batch.id == batch_id, Batch.ended_at.is_(None))
        .values(**_draft_counters(stats))
        .execution_options(synchronize_session=False)
    )


def end_batch(session: Session, batch_id: int, stats: EngineStats) -> None:
    session.execute(
        update(Batch)
        .where(Batch.id == batch_id)
        .values(
            ended_at=utcnow(),
            **_draft_counters(stats),
            num_generated_tokens=stats.num_generated_tokens,
            num_steps=stats.num_steps,
            target_forwards=stats.target_forwards,
            draft_forwards=stats.draft_forwards,
            prefill_tokens=stats.prefill_tokens,
            seconds=stats.time_total_s,
        )
        .execution_options(synchronize_session=False)
    )
