"""The draft a `--draft train:N` job trains for itself (jobs/draft_training.py), on whichever worker
first needs it once the job's first N requests have ended.

A worker running a chunk past the first N asks `speculating_pair` for its models:
- the head is ready (its row in `trained_drafts`): loaded onto this worker's target, kept for the job;
- it failed to train, or another worker is training it, or some of the first N have not ended: the
  target alone (speculation is lossless: the outputs are the same, only slower);
- else this worker claims the training (a row inserted, or a dead trainer's lapsed claim taken over),
  trains on the first N completions (distill/job_head.py), renewing its claim as it goes, stores the
  head and speculates with it. Training that fails marks the row failed; a head whose budget ran out
  before it learnt anything is marked untrained, and one that its own chains measure worse than no
  draft rejected; each with the reason `status` shows, and the job goes on with its model-free
  proposers, if it asked for them, or the target alone. A worker told to stop gives the claim back at
  once.

The training phase ends by its budget in wall time (distill/job_head.py wall_time_limit), on a clock
`SPECQ_FAULT_TRAINING_TICK_S` may replace (worker/faults.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from specq.db.models import Job, Request, Result, TrainedDraft
from specq.db.states import DRAFT_TRAINING_TRANSITIONS, NOT_CLAIMABLE, DraftTrainingState, RequestState
from specq.db.types import utcnow

if TYPE_CHECKING:
    from specq.decoding.draft_head import DraftHead
    from specq.distill.corpus import Decoded
    from specq.jobs.settings import JobSettings
    from specq.models.loading import ModelPair
    from specq.worker.context import WorkerContext

log = logging.getLogger(__name__)

TRAINING, READY, FAILED = DraftTrainingState.TRAINING, DraftTrainingState.READY, DraftTrainingState.FAILED
UNTRAINED, REJECTED = DraftTrainingState.UNTRAINED, DraftTrainingState.REJECTED
MAX_TRAINED_HEADS = 4  # jobs whose head a worker keeps loaded


class _Stopping(Exception):
    """The worker was told to stop while training, or the job was cancelled or expired."""


def speculating_pair(
    ctx: WorkerContext,
    job: Job,
    settings: JobSettings,
    target_only: ModelPair,
    now: Callable[[], datetime] = utcnow,
) -> ModelPair:
    """The models for the job's requests past its first N: the target with the job's trained head, or
    the target alone where there is none yet (see the module's docstring)."""
    from specq.models.loading import ModelPair

    training = settings.draft_training
    assert training is not None
    head = _kept_head(ctx, job.id, target_only)
    if head is None:
        head = _stored_head(ctx, job.id, target_only)
    if head is None:
        head = _train_if_due(ctx, job, settings, target_only, now)
    if head is None:
        return target_only
    return ModelPair(
        target=target_only.target,
        draft=head,
        tokenizer=target_only.tokenizer,
        target_name=target_only.target_name,
        draft_name=f"{training.describe()} (job {job.id})",
    )


def _kept_head(ctx: WorkerContext, job_id: str, target_only: ModelPair) -> DraftHead | None:
    kept = ctx.trained_heads.get(job_id)
    if kept is None or kept[0] is not target_only.target:  # loaded onto a target since unloaded
        return None
    ctx.trained_heads.move_to_end(job_id)
    return kept[1]


def _keep(ctx: WorkerContext, job_id: str, target: Any, head: DraftHead) -> DraftHead:
    ctx.trained_heads[job_id] = (target, head)
    ctx.trained_heads.move_to_end(job_id)
    while len(ctx.trained_heads) > MAX_TRAINED_HEADS:
        ctx.trained_heads.popitem(last=False)
    return head


def _stored_head(ctx: WorkerContext, job_id: str, target_only: ModelPair) -> DraftHead | None:
    from specq.distill.job_head import restored_head

    with ctx.db.session() as session:
        row = session.get(TrainedDraft, job_id)
        if row is None or row.state != READY or row.head_config is None or row.head_weights is None:
            return None
        config, weights = row.head_config, row.head_weights
    head = restored_head(config, weights, target_only.target)
    log.info("job %s: speculating with its trained draft head", job_id)
    return _keep(ctx, job_id, target_only.target, head)


def _first_requests_pending(session: Any, job_id: str, prompts: int) -> int:
    """How many of the job's first `prompts` requests have not ended (queued or running)."""
    return int(
        session.scalar(
            select(func.count())
            .select_from(Request)
            .where(
                Request.job_id == job_id,
                Request.seq < prompts,
                Request.state.in_([RequestState.QUEUED, RequestState.RUNNING]),
            )
        )
    )


def claim_training(ctx: WorkerContext, job_id: str, prompts: int, now: Callable[[], datetime] = utcnow) -> bool:
    """Whether this worker now holds the job's training: none has started and the first `prompts`
    requests have all ended, or the worker training it stopped renewing its claim."""
    lease = timedelta(seconds=ctx.config.queue.lease_s)
    owner = ctx.config.name
    with ctx.db.session() as session:
        row = session.get(TrainedDraft, job_id)
        if row is not None and row.state != TRAINING:
            return False
        if _first_requests_pending(session, job_id, prompts):
            return False
        if row is None:  # another worker inserting it first inserts nothing here
            inserted = session.execute(
                _insert_if_absent(session).values(
                    job_id=job_id, state=TRAINING, owner=owner, lease_expires_at=now() + lease, started_at=now()
                )
            )
            return bool(inserted.rowcount)  # type: ignore[attr-defined]
        taken = session.execute(
            update(TrainedDraft)
            .where(
                TrainedDraft.job_id == job_id,
                TrainedDraft.state == TRAINING,
                or_(TrainedDraft.lease_expires_at < now(), TrainedDraft.owner == owner),
            )
            .values(owner=owner, lease_expires_at=now() + lease, started_at=now())
        )
        if taken.rowcount:  # type: ignore[attr-defined]
            log.warning("job %s: the worker training its draft stopped renewing its claim; training here", job_id)
        return bool(taken.rowcount)  # type: ignore[attr-defined]


def _train_if_due(
    ctx: WorkerContext, job: Job, settings: JobSettings, target_only: ModelPair, now: Callable[[], datetime]
) -> DraftHead | None:
    training = settings.draft_training
    assert training is not None
    if not claim_training(ctx, job.id, training.prompts, now):
        return None
    from specq.distill.job_head import head_config, head_weights, train_job_head
    from specq.worker.faults import training_clock

    sequences = training_sequences(ctx, job, settings, target_only)
    log.info("job %s: training its draft head on %d completions (%s)", job.id, len(sequences), training.budget)
    renewed = [time.monotonic()]

    def stop_if_asked(*_progress: Any) -> None:  # a Ctrl-C in embedded mode, SIGTERM on a worker
        if ctx.shared.stopping.is_set():
            raise _Stopping

    def on_step(_state: Any) -> None:
        stop_if_asked()
        if time.monotonic() - renewed[0] >= ctx.config.queue.lease_s / 3:
            if not renew_training(ctx, job.id, now):  # cancelled or expired meanwhile: nothing will speculate
                raise _Stopping
            renewed[0] = time.monotonic()

    try:
        trained = train_job_head(
            target_only.target,
            sequences,
            training.parsed_budget,
            depth=settings.decoding.draft_model_depth,
            on_step=on_step,
            clock=training_clock(),
            on_read=stop_if_asked,
        )
    except _Stopping:
        _release(ctx, job.id)
        log.info("job %s: stopped training its draft (the worker is stopping, or the job ended)", job.id)
        return None
    except Exception as exc:  # no completion to learn from, out of memory, ...: the job goes on without
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        log.warning("job %s: training its draft failed (%s); the target decodes the rest alone", job.id, reason)
        finish_training(ctx, job.id, state=FAILED, error=reason, now=now)
        return None
    unusable = why_unusable(trained.report)
    if unusable is not None:
        state, reason = unusable
        log.warning("job %s: its draft head is %s (%s); the rest runs without it", job.id, state, reason)
        finish_training(ctx, job.id, state=state, error=reason, now=now, report=trained.report)
        return None
    finish_training(
        ctx,
        job.id,
        state=READY,
        now=now,
        head_config=head_config(trained.head),
        head_weights=head_weights(trained.head),
        report=trained.report,
    )
    log.info("job %s: its draft head is trained (%s)", job.id, trained.report)
    return _keep(ctx, job.id, target_only.target, trained.head)


def why_unusable(report: dict[str, Any]) -> tuple[DraftTrainingState, str] | None:
    """Whether a trained head would cost more than it gives, and why: untrained where no step trained a
    token (its budget ran out first), rejected where its first proposals match the target on under
    USEFUL_AGREEMENT of its own chains; None where it is worth speculating with."""
    from specq.distill.job_head import USEFUL_AGREEMENT

    if not report.get("chain_tokens"):
        return UNTRAINED, report.get("stopped") or "no training step had a token to learn"
    agreement = report.get("agreement")
    if agreement is not None and agreement < USEFUL_AGREEMENT:
        return REJECTED, (
            f"its first proposals match the target's tokens on {agreement:.1%} of the chains it trained on, "
            f"under the {USEFUL_AGREEMENT:.0%} a draft needs to pay for itself"
        )
    return None


def training_sequences(ctx: WorkerContext, job: Job, settings: JobSettings, target_only: ModelPair) -> list[Decoded]:
    """The first N requests' prompts (as the engine took them) and completions, those that completed."""
    from specq.decoding.types import GenerationRequest
    from specq.distill.corpus import Decoded
    from specq.jobs.params import engine_request
    from specq.worker.claims import ClaimedRequest

    assert settings.draft_training is not None
    with ctx.db.session() as session:
        rows = session.execute(
            select(Request, Result.token_ids)
            .join(Result, Result.request_id == Request.id)
            .where(
                Request.job_id == job.id,
                Request.seq < settings.draft_training.prompts,
                Result.status == RequestState.COMPLETED,
            )
            .order_by(Request.seq)
        ).all()
        lines = [
            (
                ClaimedRequest(r.id, r.seq, r.custom_id, r.kind, r.prompt, r.messages, r.overrides, r.prompt_token_ids),
                tokens,
            )
            for r, tokens in rows
        ]
    sequences = []
    for line, tokens in lines:
        prepared = engine_request(line.id, line, target_only.tokenizer, settings.sampling)
        if isinstance(prepared, GenerationRequest) and tokens:
            sequences.append(Decoded(tuple(prepared.prompt_token_ids), tuple(tokens)))
    return sequences


def _insert_if_absent(session: Any) -> Any:
    insert = postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert
    return insert(TrainedDraft).on_conflict_do_nothing(index_elements=["job_id"])


def renew_training(ctx: WorkerContext, job_id: str, now: Callable[[], datetime]) -> bool:
    """Extend this worker's claim on the training; False where the job can no longer run (cancelled,
    expired, deleted)."""
    with ctx.db.session() as session:
        state = session.scalar(select(Job.state).where(Job.id == job_id))
        session.execute(
            update(TrainedDraft)
            .where(TrainedDraft.job_id == job_id, TrainedDraft.owner == ctx.config.name)
            .values(lease_expires_at=now() + timedelta(seconds=ctx.config.queue.lease_s))
        )
    return state is not None and state not in NOT_CLAIMABLE


def _release(ctx: WorkerContext, job_id: str) -> None:
    with ctx.db.session() as session:
        session.execute(
            delete(TrainedDraft).where(
                TrainedDraft.job_id == job_id, TrainedDraft.owner == ctx.config.name, TrainedDraft.state == TRAINING
            )
        )


def finish_training(ctx: WorkerContext, job_id: str, *, state: str, now: Callable[[], datetime], **values: Any) -> None:
    """Mark the training ended, where this worker still holds it (a worker whose claim was taken over
    keeps its head for its own chunk and stores nothing)."""
    assert state in DRAFT_TRAINING_TRANSITIONS[TRAINING] and state != TRAINING, state
    with ctx.db.session() as session:
        session.execute(
            update(TrainedDraft)
            .where(TrainedDraft.job_id == job_id, TrainedDraft.owner == ctx.config.name, TrainedDraft.state == TRAINING)
            .values(state=state, owner=None, lease_expires_at=None, finished_at=now(), **values)
        )
