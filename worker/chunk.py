"""Run one chunk of a job: claim, tokenize, batch, generate, store. The task body, without Celery.

The queue's Celery task and the embedded mode (no broker: `submit` runs the job in-process) both call
`run_chunk`, so there is one implementation of how a request becomes a result.

What can go wrong on the way, and what happens then:

- the device runs out of memory: the batch is split (the engine's batch size halved) and the requests
  it had not finished run again; a request that does not fit even alone fails with the error;
- the worker is told to stop (SIGTERM): the engine gets no new request, the batch in hand finishes, and
  the chunk's other requests are given back to the queue at once (their chunk is enqueued again);
- the database goes away: the chunk is run again once it answers (`run_chunk_patiently` waits in
  place, then Celery retries with backoff); every write is one transaction, so nothing is
  half-written, and the claims a failed try held are given back by the heartbeat;
- the worker dies: its leases expire and a sweeper requeues its requests (`worker.claims`); the ones
  it had started run alone next time, and fail once they have killed `max_attempts` workers.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import update
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError

from specq.db.models import Job, Worker
from specq.db.session import Database
from specq.db.states import JobState, WorkerState
from specq.db.types import utcnow
from specq.decoding.stats import EngineStats
from specq.decoding.types import GenerationRequest, GenerationResult
from specq.jobs.params import decoding_config, engine_request
from specq.queue import QUEUE, QueueSettings
from specq.worker import faults
from specq.worker.claims import (
    ClaimedRequest,
    cancel_claimed,
    claim_chunk,
    exhausted_result,
    mark_started,
    max_attempts,
    release_claimed,
)
from specq.worker.model_cache import ModelCache
from specq.worker.results import end_batch, start_batch, store_results

if TYPE_CHECKING:
    from specq.decoding.k_policy import SpeculationPolicy
    from specq.models.loading import ModelPair
    from specq.worker.metrics import WorkerMetrics

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
    # one adaptive-k policy per model pair and speculation setting, so the step times and acceptance it
    # measured carry over from batch to batch instead of being learnt again each time
    policies: dict[tuple, SpeculationPolicy] = field(default_factory=dict)
    queue: QueueSettings = QUEUE
    metrics: WorkerMetrics | None = None
    registered: bool = False  # True: a row in the workers table shows this worker's state
    broker: str | None = None  # where requests given back are enqueued again; None: in-process
    # set on SIGTERM: the batch in hand finishes, the rest of the chunk goes back to the queue
    stopping: threading.Event = field(default_factory=threading.Event)
    # requests this process marked started and has not finished: when a chunk is retried here (the
    # database went away) they are neither suspects nor counted as started again
    started: set[int] = field(default_factory=set)
    # the claims of the chunk in hand, whose leases the heartbeat renews (replaced, never mutated)
    holding: frozenset[int] = frozenset()
    # chunks a database error cut short -> their claims, which the heartbeat gives back (queued, chunk
    # enqueued again) as soon as the database answers, instead of leaving them to expire
    abandoned: dict[tuple[str, int, int], frozenset[int]] = field(default_factory=dict)
    # taken while claiming and while giving abandoned claims back: the two never cross
    claims_lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class _Prepared:
    """A claimed request and its engine request."""

    claimed: ClaimedRequest
    request: GenerationRequest


def _prepare(
    pair: ModelPair, claimed: list[ClaimedRequest], defaults: dict[str, Any]
) -> tuple[list[_Prepared], list[GenerationResult]]:
    """Tokenize and resolve sampling settings; a request that cannot be prepared fails alone."""
    ready, failed = [], []
    for request in claimed:
        prepared = engine_request(request.id, request, pair.tokenizer, defaults)
        if isinstance(prepared, GenerationResult):
            failed.append(prepared)
        else:
            ready.append(_Prepared(request, prepared))
    return ready, failed


def _groups(ready: list[_Prepared], suspects: set[int]) -> list[list[_Prepared]]:
    """Batches of compatible requests, each sorted by prompt length (less padding, similar lengths).

    Greedy and sampled requests batch apart: they accept draft tokens at very different rates, and the
    engine picks its number of draft tokens per step from the batch's measured acceptance. Suspects
    (started before by a worker that died) come last, each alone: if one of them is what kills workers,
    it takes no other request down with it, and the chunk's other work is stored first.
    """
    fresh = [p for p in ready if p.claimed.id not in suspects]
    greedy = [p for p in fresh if p.request.params.temperature == 0.0]
    sampled = [p for p in fresh if p.request.params.temperature != 0.0]
    groups = [sorted(g, key=lambda p: len(p.request.prompt_token_ids)) for g in (greedy, sampled) if g]
    return groups + [[p] for p in ready if p.claimed.id in suspects]


def is_out_of_memory(exc: BaseException) -> bool:
    """Device or host memory ran out: torch's OutOfMemoryError (CUDA), MemoryError, or the RuntimeError
    torch's CPU allocator raises."""
    import torch

    if isinstance(exc, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError) | MemoryError):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc).lower()
        return any(s in text for s in ("out of memory", "can't allocate memory", "cannot allocate memory"))
    return False


def _free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


class _Feed:
    """Hands a group's requests to the engine as it pulls them (it pulls lazily, a free slot at a time).

    Before a request is handed over, it is marked started in the database, a block of up to a batch
    ahead (one write per batch, not per request), so a worker that dies leaves its suspects marked. It
    stops handing requests out once the worker is stopping: the engine then finishes what it holds.
    """

    def __init__(self, ctx: WorkerContext, block: int) -> None:
        self.ctx, self.block = ctx, block
        self.marked: set[int] = set()  # marked started in the database by this feed
        self.handed: set[int] = set()  # given to an engine, in any attempt
        self.in_flight: dict[int, None] = {}  # given to the current attempt's engine and not finished

    def requests(self, prepared: list[_Prepared]) -> Iterator[GenerationRequest]:
        self.in_flight = {}
        oom_above = faults.oom_above()
        for i, p in enumerate(prepared):
            if self.ctx.stopping.is_set():
                return
            if oom_above is not None and len(self.in_flight) >= oom_above:
                raise faults.simulated_oom(len(self.in_flight) + 1, oom_above)
            request_id = p.claimed.id
            started = self.ctx.started
            if request_id not in started:
                block = [q.claimed.id for q in prepared[i : i + self.block] if q.claimed.id not in started]
                with self.ctx.db.session() as session:
                    mark_started(session, block, self.ctx.name)
                self.marked.update(block)
                started.update(block)
            faults.maybe_crash(p.claimed.prompt)
            self.handed.add(request_id)
            self.in_flight[request_id] = None
            yield p.request

    def finished(self, request_id: int) -> None:
        self.in_flight.pop(request_id, None)

    @property
    def unstarted(self) -> set[int]:
        """Marked started, never handed to an engine."""
        return self.marked - self.handed


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


def _generate_group(
    ctx: WorkerContext, job: Job, pair: ModelPair, group: list[_Prepared], writer: _Writer, unstarted: set[int]
) -> set[int]:
    """Run one group through the engine, splitting the batch on out-of-memory errors; returns the
    request ids it did not finish (the job was cancelled, or the worker is stopping). Ids marked started
    but never handed to the engine are added to `unstarted`."""
    from specq.decoding.engine import SpeculativeEngine

    config = decoding_config(job.settings)
    batch_size = config.batch_size
    pending = {p.claimed.id: p for p in group}  # in the group's order
    feed = _Feed(ctx, block=batch_size)
    while pending and not writer.cancelled:
        with ctx.db.session() as session:
            batch_id = start_batch(session, job.id, ctx.name, ctx.device, len(pending))
        _set_worker(ctx, WorkerState.BUSY, job.id, batch_id)
        policy_key = (job.target, job.draft, job.settings.get("dtype"), config.num_speculative_tokens, config.fixed_k)
        engine = SpeculativeEngine(
            pair.target,
            pair.tokenizer,
            pair.draft,
            replace(config, batch_size=batch_size),
            policy=ctx.policies.get(policy_key),
        )
        ctx.policies[policy_key] = engine.policy
        results: Iterator[GenerationResult] = engine.generate(feed.requests(list(pending.values())))
        out_of_memory: BaseException | None = None
        try:
            for result in results:
                pending.pop(result.key, None)
                feed.finished(result.key)
                writer.add(result, hold=not pending)
                if ctx.metrics is not None:
                    ctx.metrics.set_load(job.target, ctx.device, len(pending), batch_size)
                if writer.cancelled:
                    break
        except SQLAlchemyError:
            raise  # the database, not the engine: the task retries the chunk
        except Exception as exc:
            if is_out_of_memory(exc):
                out_of_memory = exc
            else:
                # the engine failed the whole batch (a bug, a bad kernel): its unfinished requests fail
                # with the reason; `specq retry` can requeue them
                log.exception("the engine failed on a batch of job %s", job.id)
                for request_id in list(pending):
                    writer.add(GenerationResult.failed(request_id, f"the engine failed: {type(exc).__name__}: {exc}"))
                pending.clear()
        finally:
            close = getattr(results, "close", None)
            if close is not None:
                close()
            writer.flush(batch=(batch_id, engine.stats))
            if ctx.metrics is not None:
                ctx.metrics.add_stats(job.target, ctx.device, engine.stats)
                ctx.metrics.set_load(job.target, ctx.device, 0, batch_size)
        if out_of_memory is None:
            break  # done; or cancelled (what is left is given up); or stopping (what is left was never handed over)
        del engine, results
        _free_memory(ctx.device)
        if batch_size > 1:
            batch_size = max(1, batch_size // 2)
            log.warning(
                "job %s: out of memory (%s); retrying %d requests at batch size %d",
                job.id,
                out_of_memory,
                len(pending),
                batch_size,
            )
            continue
        # alone and still out of memory: the request in the engine fails, the others go on
        culprits = [i for i in feed.in_flight if i in pending] or [next(iter(pending))]
        for request_id in culprits:
            pending.pop(request_id)
            writer.add(GenerationResult.failed(request_id, f"out of memory even in a batch of one: {out_of_memory}"))
        log.warning("job %s: %d requests do not fit even alone; failed", job.id, len(culprits))
    unstarted |= feed.unstarted
    return set(pending)


def run_chunk(ctx: WorkerContext, job_id: str, first: int, end: int) -> dict[str, int]:
    """Process the requests of job `job_id` at positions [first, end) that are still to do.

    Returns counts for the task's log line: claimed, written (results stored), cancelled, released
    (given back to the queue because the worker is stopping).
    """
    nothing = {"claimed": 0, "written": 0, "cancelled": 0, "released": 0}
    if ctx.stopping.is_set():
        return nothing  # a task delivered after SIGTERM: claim nothing, the message is acknowledged
    chunk = (job_id, first, end)
    with ctx.claims_lock, ctx.db.session() as session:
        job = session.get(Job, job_id)
        if job is None:
            log.warning("job %s is gone; dropping chunk [%d, %d)", job_id, first, end)
            return nothing
        if job.state == JobState.CANCELLED:
            return nothing
        claimed = claim_chunk(session, job_id, first, end, ctx.name, ctx.queue.lease_s)
        session.expunge(job)
        ctx.holding = frozenset(c.id for c in claimed)
        ctx.abandoned.pop(chunk, None)  # claimed again here (a retry): nothing to give back
    if not claimed:
        return nothing
    try:
        return _run_claimed(ctx, job, claimed, chunk)
    except SQLAlchemyError:
        with ctx.claims_lock:  # the task retries; meanwhile any worker may take these, once given back
            ctx.abandoned[chunk] = ctx.abandoned.get(chunk, frozenset()) | ctx.holding
        raise
    finally:
        ctx.holding = frozenset()  # whatever happened, this process renews these leases no more


def run_chunk_patiently(
    ctx: WorkerContext, job_id: str, first: int, end: int, patience_s: float = 600.0
) -> dict[str, int]:
    """`run_chunk`, waiting out a database outage in place: retried after 1, 2, 4 ... 30 s while the
    database does not answer, for up to `patience_s` (then the error is raised) or until the worker is
    told to stop. Each try is complete or leaves nothing half-written, so a retry is always safe."""
    waited, delay, failing = 0.0, 1.0, False
    while True:
        try:
            counts = run_chunk(ctx, job_id, first, end)
        except (OperationalError, InterfaceError) as exc:
            if waited >= patience_s or ctx.stopping.is_set():
                raise
            if not failing:
                reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
                log.warning("job %s chunk [%d, %d): database unreachable (%s); waiting", job_id, first, end, reason)
                failing = True
            if ctx.stopping.wait(delay):
                raise
            waited, delay = waited + delay, min(30.0, delay * 2)
            continue
        if failing:
            log.warning("job %s chunk [%d, %d): database back after %.0fs", job_id, first, end, waited)
        return counts


def _run_claimed(
    ctx: WorkerContext, job: Job, claimed: list[ClaimedRequest], chunk: tuple[str, int, int]
) -> dict[str, int]:
    job_id, first, end = chunk
    log.info("job %s: claimed %d requests of chunk [%d, %d)", job_id, len(claimed), first, end)

    limit = max_attempts(job.settings)
    # started before, by a worker that is gone (not by this process, whose chunk a database error cut)
    elsewhere = [c for c in claimed if c.suspect and c.id not in ctx.started]
    exhausted = {c.id for c in elsewhere if c.starts >= limit}
    runnable = [c for c in claimed if c.id not in exhausted]
    suspects = {c.id for c in elsewhere} - exhausted
    if suspects:
        log.warning("job %s: %d requests were running on a worker that died; each runs alone", job_id, len(suspects))
    writer = _Writer(ctx, job_id, job.target)
    for request in claimed:
        if request.id in exhausted:
            log.warning("job %s: request %s failed after %d attempts", job_id, request.custom_id, request.starts)
            writer.add(exhausted_result(request.id, request.starts, None))
    leftover: set[int] = set()
    unstarted: set[int] = set()
    try:
        try:
            pair = ctx.models.get(job.target, job.draft, job.settings.get("dtype"), ctx.device)
        except Exception as exc:  # ModelLoadError, or out of memory while loading: the requests fail
            log.error("job %s: %s", job_id, exc)
            for request in runnable:
                writer.add(GenerationResult.failed(request.id, str(exc)))
            pair = None
        if pair is not None:
            ready, failed = _prepare(pair, runnable, job.settings.get("sampling", {}))
            for result in failed:
                writer.add(result)
            for group in _groups(ready, suspects):
                if writer.cancelled or ctx.stopping.is_set():
                    leftover.update(p.claimed.id for p in group)
                else:
                    leftover |= _generate_group(ctx, job, pair, group, writer, unstarted)
    finally:
        writer.flush()
        _set_worker(ctx, WorkerState.IDLE, None, None)
    ctx.started.difference_update(c.id for c in claimed)  # stored, cancelled or given back below
    counts = {"claimed": len(claimed), "written": writer.written, "cancelled": 0, "released": 0}
    if leftover and writer.cancelled:
        with ctx.db.session() as session:
            counts["cancelled"] = cancel_claimed(session, sorted(leftover), ctx.name)
    elif leftover:
        counts["released"] = _give_back(ctx, chunk, sorted(leftover), sorted(unstarted & leftover))
    return counts


def _give_back(ctx: WorkerContext, chunk: tuple[str, int, int], request_ids: list[int], unstarted: list[int]) -> int:
    """Put requests this stopping worker will not run back in the queue, and their chunk on the broker
    (before the commit, as the sweeper does). If that fails, their leases expire and a sweeper does it."""
    try:
        with ctx.db.session() as session:
            released = release_claimed(session, request_ids, unstarted, ctx.name)
            if released and ctx.broker is not None:
                from specq.jobs.enqueue import enqueue_chunks

                enqueue_chunks(ctx.broker, [chunk])
    except Exception as exc:
        log.warning(
            "could not give back %d requests of job %s (%s); their leases will expire", len(request_ids), chunk[0], exc
        )
        return 0
    log.info("stopping: gave %d requests of job %s back to the queue", released, chunk[0])
    return released
