"""Run one chunk of a job: claim, tokenize, batch, generate, store. The task body, without Celery.

The queue's Celery task and the embedded mode (no broker: `submit` runs the job in-process) both call
`run_chunk`, so there is one implementation of how a request becomes a result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import update

from db.models import Job, Worker
from db.session import Database
from db.states import JobState, WorkerState
from db.types import utcnow
from decoding.stats import EngineStats
from decoding.types import GenerationRequest, GenerationResult, SamplingParams
from jobs.params import decoding_config, sampling_params
from worker.claims import ClaimedRequest, cancel_claimed, claim_chunk
from worker.model_cache import ModelCache
from worker.results import end_batch, start_batch, store_results
from worker.settings import QUEUE, QueueSettings

if TYPE_CHECKING:
    from models.loading import ModelPair
    from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

FLUSH_RESULTS = 64  # results written per transaction at most ...
FLUSH_SECONDS = 0.5  # ... and at least this often while results arrive, so progress shows promptly


@dataclass
class WorkerContext:
    """What a chunk runs with: one per worker process (or per in-process `submit`)."""

    db: Database
    name: str  # the lease owner and the workers-table row
    device: str
    models: ModelCache = field(default_factory=ModelCache)
    queue: QueueSettings = QUEUE
    metrics: WorkerMetrics | None = None
    registered: bool = False  # True: a row in the workers table shows this worker's state


@dataclass
class _Prepared:
    """A claimed request ready for the engine."""

    claimed: ClaimedRequest
    prompt_ids: tuple[int, ...]
    params: SamplingParams


def _failure(request_id: int, message: str) -> GenerationResult:
    return GenerationResult(
        key=request_id, token_ids=[], text="", finish_reason=None, prompt_tokens=0, completion_tokens=0, error=message
    )


def _prepare(
    pair: ModelPair, claimed: list[ClaimedRequest], defaults: dict[str, Any]
) -> tuple[list[_Prepared], list[GenerationResult]]:
    """Tokenize and resolve sampling settings; a request that cannot be prepared fails alone."""
    from models.loading import tokenize_prompt

    ready, failed = [], []
    for request in claimed:
        try:
            params = sampling_params(defaults, request.overrides)
            ids = tokenize_prompt(pair.tokenizer, prompt=request.prompt, messages=request.messages)
        except Exception as exc:  # a chat template that fails to render, settings out of range, ...
            failed.append(_failure(request.id, f"cannot prepare the request: {exc}"))
            continue
        ready.append(_Prepared(request, tuple(ids), params))
    return ready, failed


def _groups(ready: list[_Prepared]) -> list[list[_Prepared]]:
    """Batches of compatible requests, each sorted by prompt length (less padding, similar lengths).

    Greedy and sampled requests batch apart: they accept draft tokens at very different rates, and the
    engine picks its number of draft tokens per step from the batch's measured acceptance.
    """
    greedy = [p for p in ready if p.params.temperature == 0.0]
    sampled = [p for p in ready if p.params.temperature != 0.0]
    return [sorted(g, key=lambda p: len(p.prompt_ids)) for g in (greedy, sampled) if g]


def _set_worker(ctx: WorkerContext, state: WorkerState, job_id: str | None, batch_id: int | None) -> None:
    if not ctx.registered:
        return
    with ctx.db.session() as session:
        session.execute(
            update(Worker)
            .where(Worker.name == ctx.name)
            .values(state=state, current_job=job_id, current_batch=batch_id, heartbeat_at=utcnow())
            .execution_options(synchronize_session=False)
        )


class _Writer:
    """Buffers results and writes them in small transactions; knows when the job was cancelled."""

    def __init__(self, ctx: WorkerContext, job_id: str, model: str) -> None:
        self.ctx, self.job_id, self.model = ctx, job_id, model
        self.buffer: list[GenerationResult] = []
        self.last_flush = time.monotonic()
        self.job_state: str = JobState.RUNNING
        self.written = 0

    def add(self, result: GenerationResult, hold: bool = False) -> None:
        """Buffer a result; write the buffer when it is full or old, unless `hold` (a batch's last
        result waits for the batch's counters, so both land in one transaction)."""
        self.buffer.append(result)
        if hold:
            return
        if len(self.buffer) >= FLUSH_RESULTS or time.monotonic() - self.last_flush >= FLUSH_SECONDS:
            self.flush()

    def flush(self, batch: tuple[int, EngineStats] | None = None) -> None:
        """Write the buffered results, and `batch`'s counters in the same transaction: whoever sees the
        job end (its last result committed) also sees the counters of every batch that ran for it."""
        self.last_flush = time.monotonic()
        if not self.buffer and batch is None:
            return
        with self.ctx.db.session() as session:
            if batch is not None:
                end_batch(session, *batch)
            if not self.buffer:
                return
            outcome = store_results(session, self.job_id, self.buffer, self.ctx.name)
        if self.ctx.metrics is not None:
            failures = sum(r.error is not None for r in self.buffer)
            labels = (self.model, self.ctx.device)
            self.ctx.metrics.request_failure.labels(*labels).inc(failures)
            self.ctx.metrics.request_success.labels(*labels).inc(len(self.buffer) - failures)
        self.written += len(self.buffer)
        self.job_state = outcome.job_state
        self.buffer.clear()

    @property
    def cancelled(self) -> bool:
        return self.job_state == JobState.CANCELLED


def _generate_group(ctx: WorkerContext, job: Job, pair: ModelPair, group: list[_Prepared], writer: _Writer) -> set[int]:
    """Run one batch through the engine; returns the request ids it did not finish (cancelled job)."""
    from decoding.engine import SpeculativeEngine

    config = decoding_config(job.settings)
    with ctx.db.session() as session:
        batch_id = start_batch(session, job.id, ctx.name, ctx.device, len(group))
    _set_worker(ctx, WorkerState.BUSY, job.id, batch_id)
    engine = SpeculativeEngine(pair.target, pair.tokenizer, pair.draft, config)
    requests = [GenerationRequest(p.claimed.id, p.prompt_ids, p.params) for p in group]
    pending = {p.claimed.id for p in group}
    results: Iterator[GenerationResult] = engine.generate(requests)
    try:
        for result in results:
            pending.discard(result.key)
            writer.add(result, hold=not pending)
            if ctx.metrics is not None:
                ctx.metrics.set_load(job.target, ctx.device, len(pending), config.batch_size)
            if writer.cancelled:
                break
    except Exception as exc:
        # the engine failed the whole batch (out of memory, a bug): its unfinished requests fail with
        # the reason; `specq retry` can requeue them
        log.exception("the engine failed on a batch of job %s", job.id)
        for request_id in sorted(pending):
            writer.add(_failure(request_id, f"the engine failed: {type(exc).__name__}: {exc}"))
        pending.clear()
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
        writer.flush(batch=(batch_id, engine.stats))
        if ctx.metrics is not None:
            ctx.metrics.add_stats(job.target, ctx.device, engine.stats)
            ctx.metrics.set_load(job.target, ctx.device, 0, config.batch_size)
    return pending


def run_chunk(ctx: WorkerContext, job_id: str, first: int, end: int) -> dict[str, int]:
    """Process the requests of job `job_id` at positions [first, end) that are still to do.

    Returns counts for the task's log line: claimed, written (results stored), cancelled.
    """
    with ctx.db.session() as session:
        job = session.get(Job, job_id)
        if job is None:
            log.warning("job %s is gone; dropping chunk [%d, %d)", job_id, first, end)
            return {"claimed": 0, "written": 0, "cancelled": 0}
        if job.state == JobState.CANCELLED:
            return {"claimed": 0, "written": 0, "cancelled": 0}
        claimed = claim_chunk(session, job_id, first, end, ctx.name, ctx.queue.lease_s)
        session.expunge(job)
    if not claimed:
        return {"claimed": 0, "written": 0, "cancelled": 0}
    log.info("job %s: claimed %d requests of chunk [%d, %d)", job_id, len(claimed), first, end)

    writer = _Writer(ctx, job_id, job.target)
    leftover: set[int] = set()
    try:
        try:
            pair = ctx.models.get(job.target, job.draft, job.settings.get("dtype"), ctx.device)
        except Exception as exc:  # ModelLoadError, or out of memory while loading: the requests fail
            log.error("job %s: %s", job_id, exc)
            for request in claimed:
                writer.add(_failure(request.id, str(exc)))
            pair = None
        if pair is not None:
            ready, failed = _prepare(pair, claimed, job.settings.get("sampling", {}))
            for result in failed:
                writer.add(result)
            for group in _groups(ready):
                if writer.cancelled:
                    leftover.update(p.claimed.id for p in group)
                else:
                    leftover |= _generate_group(ctx, job, pair, group, writer)
    finally:
        writer.flush()
        _set_worker(ctx, WorkerState.IDLE, None, None)
    cancelled = 0
    if leftover:
        with ctx.db.session() as session:
            cancelled = cancel_claimed(session, sorted(leftover), ctx.name)
    return {"claimed": len(claimed), "written": writer.written, "cancelled": cancelled}
