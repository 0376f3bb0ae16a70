"""Job status and metrics, derived on read from raw counters (vLLM's definitions):

- acceptance rate = accepted tokens / draft tokens;
- mean acceptance length = 1 + accepted tokens / drafts (each draft also yields a recovered or bonus
  token);
- acceptance per position i = drafts whose token i was accepted / drafts;
- acceptance by proposer: the same rate over the drafts of one proposer (the draft model, prompt
  lookup `ngram`, the suffix index `suffix`);
- tokens per second = generated tokens / wall time since the job started (to its end, or to now):
  the job's throughput across all its workers.

Generated tokens count completed requests' completion tokens (the job's counter, exact); the draft
counters are summed over the job's ended batches (a batch whose worker died reports nothing).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from specq.db.models import Batch, Job, Worker
from specq.db.session import Database, schema_ready
from specq.db.states import JOB_TERMINAL, WorkerState
from specq.db.types import utcnow
from specq.decoding.stats import PROPOSER_COUNTERS, empty_by_proposer
from specq.errors import JobNotFoundError
from specq.queue import QueueSettings


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _speculation(session: Session, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Per job: summed draft counters and per-position acceptance."""
    out: dict[str, dict[str, Any]] = {
        job_id: {
            "num_drafts": 0,
            "num_draft_tokens": 0,
            "num_accepted_tokens": 0,
            "per_position": [],
            "by_proposer": empty_by_proposer(),
        }
        for job_id in job_ids
    }
    rows = session.execute(
        select(
            Batch.job_id,
            Batch.num_drafts,
            Batch.num_draft_tokens,
            Batch.num_accepted_tokens,
            Batch.accepted_per_position,
            Batch.by_proposer,
        ).where(Batch.job_id.in_(job_ids), Batch.ended_at.is_not(None))
    )
    for job_id, drafts, draft_tokens, accepted, per_position, by_proposer in rows:
        agg = out[job_id]
        agg["num_drafts"] += drafts
        agg["num_draft_tokens"] += draft_tokens
        agg["num_accepted_tokens"] += accepted
        sums = agg["per_position"]
        for i, n in enumerate(per_position or []):
            if i < len(sums):
                sums[i] += n
            else:
                sums.append(n)
        for name, counters in (by_proposer or {}).items():
            totals = agg["by_proposer"].setdefault(name, dict.fromkeys(PROPOSER_COUNTERS, 0))
            for key in PROPOSER_COUNTERS:
                totals[key] += int(counters.get(key, 0))
    return out


def _describe(job: Job, spec: dict[str, Any], now: datetime) -> dict[str, Any]:
    drafts, draft_tokens, accepted = spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]
    elapsed = ((job.finished_at or now) - job.started_at).total_seconds() if job.started_at else 0.0
    return {
        "id": job.id,
        "state": job.state,
        "total": job.total,
        "completed": job.completed,
        "failed": job.failed,
        "remaining": job.total - job.completed - job.failed,
        "generated_tokens": job.generated_tokens,
        "tokens_per_second": job.generated_tokens / elapsed if elapsed > 0 else 0.0,
        # 0.0 with no drafts yet (or no draft model), as EngineStats reports it
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 0.0,
        "acceptance_per_position": [n / drafts for n in spec["per_position"]] if drafts else [],
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "acceptance_by_proposer": {
            name: {
                **counters,
                "acceptance_rate": counters["accepted_tokens"] / counters["draft_tokens"]
                if counters["draft_tokens"]
                else 0.0,
            }
            for name, counters in spec["by_proposer"].items()
        },
        "target": job.target,
        "draft": job.draft,
        "model_free": job.settings.get("decoding", {}).get("model_free"),
        "input": job.input_name,
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
        "elapsed_s": elapsed,
    }


def job_status(db: Database, job_id: str) -> dict[str, Any]:
    """One job's state, counts and metrics; JobNotFoundError if there is none with this id."""
    with db.session() as session:
        job = session.get(Job, job_id) if schema_ready(db) else None
        if job is None:
            raise JobNotFoundError(f"no job has the id {job_id!r}")
        return _describe(job, _speculation(session, [job.id])[job.id], utcnow())


def recent_jobs(db: Database, limit: int = 20) -> list[dict[str, Any]]:
    """The `limit` most recent jobs, newest first."""
    if not schema_ready(db):
        return []  # an empty database: nothing submitted yet
    with db.session() as session:
        jobs = session.scalars(select(Job).order_by(Job.created_at.desc(), Job.id).limit(limit)).all()
        spec = _speculation(session, [job.id for job in jobs])
        now = utcnow()
        return [_describe(job, spec[job.id], now) for job in jobs]


def job_ended(state: str) -> bool:
    return state in JOB_TERMINAL


def live_workers(db: Database, include_gone: bool = False) -> list[dict[str, Any]]:
    """Workers that are not stopped and whose heartbeat is recent, by device and name.

    `include_gone`: also those that stopped, and those whose heartbeat is older than `live_after` (state
    "lost": killed, or cut off from the database; a sweeper requeues their requests). Each has its
    heartbeat's age in seconds, and its current batch and job while busy.
    """
    if not schema_ready(db):
        return []  # an empty database: no worker ever started
    now = utcnow()
    live_after = QueueSettings.from_env().live_after  # read now: the workers' timings, from the environment
    with db.session() as session:
        query = select(Worker).order_by(Worker.device, Worker.name)
        if not include_gone:
            query = query.where(Worker.state != WorkerState.STOPPED)
        rows = session.scalars(query).all()
    listed = []
    for w in rows:
        age = (now - w.heartbeat_at).total_seconds()
        live = w.state != WorkerState.STOPPED and age <= live_after
        if not live and not include_gone:
            continue
        listed.append(
            {
                "name": w.name,
                "device": w.device,
                "state": w.state if live or w.state == WorkerState.STOPPED else "lost",
                "last_heartbeat": _iso(w.heartbeat_at),
                "heartbeat_age_s": round(age, 1),
                "current_batch": w.current_batch,
                "current_job": w.current_job,
                "host": w.host,
                "pid": w.pid,
                "started_at": _iso(w.started_at),
            }
        )
    return listed
