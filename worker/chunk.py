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
  it had started (suspects) run again by bisection, in halves, then quarters ..., and one fails once it
  has killed `max_attempts` workers, the last one alone.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import update
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError

from specq.db.locks import lock_job
from specq.db.models import Job, Worker
from specq.db.session import identity
from specq.db.states import NOT_CLAIMABLE, JobState, WorkerState
from specq.db.types import utcnow
from specq.decoding.config import DecodingConfig
from specq.decoding.stats import EngineStats
from specq.decoding.types import GenerationRequest, GenerationResult
from specq.errors import ModelCompileError
from specq.jobs.expiry import expire_if_due
from specq.jobs.params import engine_request
from specq.jobs.settings import JobSettings
from specq.queue import Chunk
from specq.worker import faults
from specq.worker.claims import (
    ClaimedRequest,
    cancel_claimed,
    claim_chunk,
    exhausted,
    exhausted_result,
    mark_started,
    release_claimed,
    suspect_groups,
    take_back_starts,
)
from specq.worker.context import WorkerContext
from specq.worker.metrics import served_model_name
from specq.worker.results import end_batch, record_batch_progress, start_batch, store_results
from specq.worker.startup import is_worker_side_load_failure

if TYPE_CHECKING:
    from specq.decoding.engine import SpeculativeEngine
    from specq.models.loading import ModelPair

log = logging.getLogger(__name__)

FLUSH_RESULTS = 64  # results written per transaction at most ...
FLUSH_SECONDS = 0.5  # ... and at least this often while results arrive, so progress shows promptly


@dataclass(frozen=True)
class _Prepared:
    """A claimed request and its engine request."""

    claimed: ClaimedRequest
    request: GenerationRequest


@dataclass(frozen=True)
class _Triage:
    """A chunk's claims sorted before anything runs."""

    runnable: list[ClaimedRequest]
    # started before by a worker that died: they run last, in these groups (ids; worker.claims' bisection)
    suspects: list[list[int]]
    exhausted: list[GenerationResult]  # suspects that killed too many workers: failed, not run


@dataclass(frozen=True)
class _Group:
    """Requests that run through one engine together; `suspect`: a group of suspects (bisection)."""

    requests: list[_Prepared]
    suspect: bool = False


@dataclass
class _Unfinished:
    """What a run left undone: `ids` (the job was cancelled, or the worker is stopping), and of all the
    requests it marked started, those never handed to an engine (`unstarted`)."""

    ids: set[int] = field(default_factory=set)
    unstarted: set[int] = field(default_factory=set)

    def __ior__(self, other: _Unfinished) -> _Unfinished:
        self.ids |= other.ids
        self.unstarted |= other.unstarted
        return self


def _prepare(
    ctx: WorkerContext, pair: ModelPair, claimed: list[ClaimedRequest], settings: JobSettings
) -> tuple[list[_Prepared], list[GenerationResult]]:
    """Resolve sampling settings over the job's and take the prompt's token ids; a request that cannot
    be prepared fails alone.

    Chat lines come rendered (at submit, `jobs.chat_template`): no template runs here. Only the chat
    lines of a job stored before that are rendered, under the bounds of `jobs.chat_render`, and each is
    counted started first, so a rendering that kills this worker counts against the line's attempts."""
    from specq.models.loading import has_chat_template

    ready, failed = [], []
    unrendered = [r.id for r in claimed if r.messages is not None and r.prompt_token_ids is None]
    chat = None
    if unrendered and (settings.chat_template is not None or has_chat_template(pair.tokenizer)):
        from specq.jobs.chat_render import ChatTokens

        with ctx.db.session() as session:
            mark_started(session, unrendered, ctx.config.name)
        ctx.started.update(unrendered)
        chat = ChatTokens(pair.tokenizer, settings.chat_template)
    try:
        for request in claimed:
            prepared = engine_request(request.id, request, pair.tokenizer, settings.sampling, chat)
            if isinstance(prepared, GenerationResult):
                failed.append(prepared)
            else:
                ready.append(_Prepared(request, prepared))
    finally:
        if chat is not None:
            chat.close()
    return ready, failed


def _groups(ready: list[_Prepared], suspects: list[list[int]]) -> list[_Group]:
    """Batches of compatible requests, each sorted by prompt length (less padding, similar lengths).

    Greedy and sampled requests batch apart: they accept draft tokens at very different rates, and the
    engine picks its number of draft tokens per step from the batch's measured acceptance. Suspects
    (started before by a worker that died) come last, in their bisection groups (`worker.claims`): if
    one of them is what kills workers, it takes only its group down with it, and the chunk's other work
    is stored first.
    """
    by_id = {p.claimed.id: p for p in ready}
    suspected = {request_id for group in suspects for request_id in group}
    fresh = [p for p in ready if p.claimed.id not in suspected]
    greedy = [p for p in fresh if p.request.params.greedy]
    sampled = [p for p in fresh if not p.request.params.greedy]
    groups = [_Group(_by_length(g)) for g in (greedy, sampled) if g]
    for ids in suspects:
        members = [by_id[i] for i in ids if i in by_id]  # some may have failed to prepare, or run apart
        if members:
            groups.append(_Group(_by_length(members), suspect=True))
    return groups


def _by_length(group: list[_Prepared]) -> list[_Prepared]:
    return sorted(group, key=lambda p: len(p.request.prompt_token_ids))


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
    Injected faults (`worker.faults`, read once per chunk) are consulted only when some are set.
    """

    def __init__(self, ctx: WorkerContext, block: int, injected: faults.Faults | None, group: int = 0) -> None:
        """`group`: the size of the suspect group it feeds, recorded with each start (0: a fresh batch)."""
        self.ctx, self.block, self.injected, self.group = ctx, block, injected, group
        self.marked: set[int] = set()  # marked started in the database by this feed
        self.handed: set[int] = set()  # given to an engine, in any attempt
        self.in_flight: dict[int, None] = {}  # given to the current attempt's engine and not finished

    def requests(self, prepared: list[_Prepared]) -> Iterator[GenerationRequest]:
        self.in_flight = {}
        stopping, started = self.ctx.shared.stopping, self.ctx.started
        for i, p in enumerate(prepared):
            if stopping.is_set():
                return
            if self.injected is not None:
                self.injected.before_entering(len(self.in_flight))
            request_id = p.claimed.id
            if request_id not in started:
                self._mark_started([q.claimed.id for q in prepared[i : i + self.block] if q.claimed.id not in started])
            if self.injected is not None:
                self.injected.entering(p.claimed.prompt)
            self.handed.add(request_id)
            self.in_flight[request_id] = None
            yield p.request

    def _mark_started(self, block: list[int]) -> None:
        with self.ctx.db.session() as session:
            mark_started(session, block, self.ctx.config.name, self.group)
        self.marked.update(block)
        self.ctx.started.update(block)

    def finished(self, request_id: int) -> None:
        self.in_flight.pop(request_id, None)

    @property
    def unstarted(self) -> set[int]:
        """Marked started, never handed to an engine."""
        return self.marked - self.handed


def _set_worker(ctx: WorkerContext, state: WorkerState, job_id: str | None, batch_id: int | None) -> None:
    if not ctx.config.registered:
        return
    with ctx.db.session() as session:
        session.execute(
            update(Worker)
            .where(Worker.name == ctx.config.name)
            .values(state=state, current_job=job_id, current_batch=batch_id, heartbeat_at=utcnow())
            .execution_options(synchronize_session=False)
        )


def _record_compiled(ctx: WorkerContext, report: dict[str, Any] | None) -> None:
    """The worker's row keeps what `--compile` did with the models it loaded last (`specq workers`);
    written when that changes, not every chunk."""
    if not ctx.config.registered or report == ctx.compiled_recorded:
        return
    with ctx.db.session() as session:
        session.execute(
            update(Worker)
            .where(Worker.name == ctx.config.name)
            .values(compiled=report)
            .execution_options(synchronize_session=False)
        )
    ctx.compiled_recorded = report


class _Writer:
    """Buffers results and writes them in small transactions; knows when the job was cancelled."""

    def __init__(self, ctx: WorkerContext, job: Job) -> None:
        self.ctx, self.job_id = ctx, job.id
        self.model = served_model_name(job.target, job.served_model_name)  # the metrics' model_name
        self.enqueued_at = job.enqueued_at or job.created_at
        self.buffer: list[GenerationResult] = []
        self.last_flush = time.monotonic()
        self.job_state: str = JobState.RUNNING
        self.written = 0
        self.running: tuple[int, EngineStats] | None = None  # the batch in the engine: (its id, its counters)

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
            if batch is None and self.running is not None:
                record_batch_progress(session, *self.running)
            # a request this live worker fails was not what killed a worker: a retry must not find it suspect
            failed_here = [r.key for r in self.buffer if r.error is not None and r.key in self.ctx.started]
            if failed_here:
                lock_job(session, self.job_id)  # the job's row first, as every writer takes it (db.locks)
                take_back_starts(session, failed_here, self.ctx.config.name)
            outcome = store_results(session, self.job_id, self.buffer, self.ctx.config.name)
        self.ctx.started.difference_update(failed_here)
        if self.ctx.metrics is not None:
            since_enqueue = (utcnow() - self.enqueued_at).total_seconds()
            self.ctx.metrics.add_results(self.model, self.ctx.config.device, self.buffer, since_enqueue)
        self.written += len(self.buffer)
        self.job_state = outcome.job_state
        self.buffer.clear()

    @property
    def cancelled(self) -> bool:
        return self.job_state == JobState.CANCELLED


# -- a batch: open -> run -> store as results come -> close (rq's perform_job) ---------------------------
def _run_batch(
    ctx: WorkerContext,
    job: Job,
    settings: JobSettings,
    pair: ModelPair,
    config: DecodingConfig,
    pending: dict[int, _Prepared],
    feed: _Feed,
    writer: _Writer,
) -> str | None:
    """One engine run over the pending requests, each result stored as it comes; returns the error's
    text when the device ran out of memory (only the text: nothing may keep the engine alive), else None.
    An engine that fails otherwise fails the requests it had not finished, with the reason."""
    batch_id = _open_batch(ctx, job.id, len(pending))
    engine = _engine(ctx, job, settings, pair, config)
    writer.running = (batch_id, engine.stats)
    results: Iterator[GenerationResult] = engine.generate(feed.requests(list(pending.values())))
    try:
        _store_as_generated(ctx, results, pending, feed, writer, config.batch_size)
    except SQLAlchemyError:
        raise  # the database, not the engine: the task retries the chunk
    except Exception as exc:
        return _engine_failed(job.id, exc, pending, writer)
    finally:
        _close_batch(ctx, results, writer, config.batch_size)
    return None


def _open_batch(ctx: WorkerContext, job_id: str, size: int) -> int:
    """The batch's row, and the worker's row busy with it; the batch's id."""
    with ctx.db.session() as session:
        batch_id = start_batch(session, job_id, ctx.config.name, ctx.config.device, size)
    _set_worker(ctx, WorkerState.BUSY, job_id, batch_id)
    return batch_id


def _engine(
    ctx: WorkerContext, job: Job, settings: JobSettings, pair: ModelPair, config: DecodingConfig
) -> SpeculativeEngine:
    """An engine for one batch, with the adaptive-k policy this worker's earlier engines on the same
    models and speculation settings measured, and the job's suffix index where it drafts from one."""
    from specq.decoding.engine import SpeculativeEngine

    policy_key = config.policy_key(job.target, pair.draft_name, settings.dtype)
    suffix_index = ctx.suffix_index(job.id) if config.model_free == "suffix" else None
    engine = SpeculativeEngine(
        pair.target, pair.tokenizer, pair.draft, config, policy=ctx.policies.get(policy_key), suffix_index=suffix_index
    )
    ctx.policies[policy_key] = engine.policy
    return engine


def _store_as_generated(
    ctx: WorkerContext,
    results: Iterator[GenerationResult],
    pending: dict[int, _Prepared],
    feed: _Feed,
    writer: _Writer,
    batch_size: int,
) -> None:
    """Store each result as the engine yields it, until none is pending or the job was cancelled."""
    for result in results:
        pending.pop(result.key, None)
        feed.finished(result.key)
        writer.add(result, hold=not pending)
        if ctx.metrics is not None:
            ctx.metrics.set_load(writer.model, ctx.config.device, len(pending), batch_size)
        if writer.cancelled:
            break


def _engine_failed(job_id: str, exc: Exception, pending: dict[int, _Prepared], writer: _Writer) -> str | None:
    """The text of an out-of-memory error, for the caller to split the batch; any other error fails the
    requests the engine had not finished, with the reason (a bug, a bad kernel: `specq retry` can
    requeue them)."""
    if is_out_of_memory(exc):
        return str(exc)
    log.exception("the engine failed on a batch of job %s", job_id)
    for request_id in list(pending):
        writer.add(GenerationResult.failed(request_id, f"the engine failed: {type(exc).__name__}: {exc}"))
    pending.clear()
    return None


def _close_batch(ctx: WorkerContext, results: Iterator[GenerationResult], writer: _Writer, batch_size: int) -> None:
    """However the run ended: stop the engine's generator, store what is buffered with the batch's
    counters (one transaction), and report the counters and an idle load to the metrics."""
    close = getattr(results, "close", None)
    if close is not None:
        close()
    batch, writer.running = writer.running, None  # (its id, the engine's counters), set as it opened
    writer.flush(batch=batch)
    if ctx.metrics is not None and batch is not None:
        ctx.metrics.add_stats(writer.model, ctx.config.device, batch[1])
        ctx.metrics.set_load(writer.model, ctx.config.device, 0, batch_size)


# -- a group: one engine run per batch size, halved on out-of-memory errors -------------------------------
def _generate_group(
    ctx: WorkerContext,
    job: Job,
    settings: JobSettings,
    pair: ModelPair,
    group: _Group,
    writer: _Writer,
    injected: faults.Faults | None,
) -> _Unfinished:
    """Run one group through the engine, halving the batch size while the device runs out of memory; a
    request that does not fit even alone fails. Returns what it did not finish: the job was cancelled
    (what is left is given up), or the worker is stopping (what is left was never handed over)."""
    config = settings.decoding
    pending = {p.claimed.id: p for p in group.requests}  # in the group's order
    feed = _Feed(ctx, config.batch_size, injected, len(group.requests) if group.suspect else 0)
    while pending and not writer.cancelled:
        out_of_memory = _run_batch(ctx, job, settings, pair, config, pending, feed, writer)
        if out_of_memory is None:
            break
        _free_memory(ctx.config.device)
        if config.batch_size > 1:
            config = replace(config, batch_size=max(1, config.batch_size // 2))
            log.warning(
                "job %s: out of memory (%s); retrying %d requests at batch size %d",
                job.id,
                out_of_memory,
                len(pending),
                config.batch_size,
            )
            continue
        # alone and still out of memory: the request in the engine fails, the others go on
        culprits = [i for i in feed.in_flight if i in pending] or [next(iter(pending))]
        for request_id in culprits:
            pending.pop(request_id)
            writer.add(GenerationResult.failed(request_id, f"out of memory even in a batch of one: {out_of_memory}"))
        log.warning("job %s: %d requests do not fit even alone; failed", job.id, len(culprits))
    return _Unfinished(set(pending), feed.unstarted)


# -- a chunk: triage -> run -> settle (rq's perform_job) ---------------------------------------------------
def _triage(ctx: WorkerContext, job: Job, settings: JobSettings, claimed: list[ClaimedRequest]) -> _Triage:
    """Which claims run, which run in suspect groups, and which have killed too many workers to run again."""
    # started before, by a worker that is gone (not by this process, whose chunk a database error cut)
    elsewhere = [c for c in claimed if c.suspect and c.id not in ctx.started]
    spent = {c.id for c in elsewhere if exhausted(c.starts, c.start_group, settings.max_attempts, settings.chunk_size)}
    groups = [[c.id for c in group] for group in suspect_groups([c for c in elsewhere if c.id not in spent])]
    if groups:
        log.warning(
            "job %s: %d requests were running on a worker that died; they run in %d groups (bisection)",
            job.id,
            sum(map(len, groups)),
            len(groups),
        )
    failed = []
    for request in claimed:
        if request.id in spent:
            log.warning("job %s: request %s failed after %d attempts", job.id, request.custom_id, request.starts)
            failed.append(exhausted_result(request.id, request.starts, None))
    return _Triage([c for c in claimed if c.id not in spent], groups, failed)


def _this_workers_fault(exc: Exception, ctx: WorkerContext, settings: JobSettings) -> bool:
    """Whether the models failed to load because of this worker, not the job: I/O, memory or the device,
    or a compile that the worker's own `--compile on` asked for (the job left it to the worker, `auto`)."""
    if isinstance(exc, ModelCompileError):
        return settings.compile == "auto" and ctx.models.compile == "on"
    return is_worker_side_load_failure(exc)


def _run(ctx: WorkerContext, job: Job, settings: JobSettings, triage: _Triage, writer: _Writer) -> _Unfinished:
    """Load the models, prepare the requests and run them group by group; every result goes to `writer`.
    Models that do not load because of this worker leave the requests unfinished (given back) and mark
    the worker unusable; models that do not fit together fail the requests, as does a request that
    cannot be prepared. A job that trains its draft (`--draft train:N`) runs its first N requests with
    the target alone, stores them, then the rest with the head it trained (worker/trained_draft.py)."""
    for result in triage.exhausted:
        writer.add(result)
    training = settings.draft_training
    try:
        pair = ctx.models.get(
            job.target,
            job.draft,
            settings.dtype,
            ctx.config.device,
            settings.compile,
            # a load takes minutes: `specq workers` says `loading MODEL` meanwhile, not `idle`
            on_load=lambda: _set_worker(ctx, WorkerState.LOADING, job.id, None),
        )
    except Exception as exc:  # ModelLoadError, or out of memory while loading
        if ctx.config.broker is not None and _this_workers_fault(exc, ctx, settings):
            # this worker's fault (disk, permissions, memory), not the job's: another worker may load
            # them, so the requests go back to the queue and this worker stops taking work
            ctx.shared.unusable = f"cannot load the models of job {job.id} on {ctx.config.device}: {exc}"
            return _Unfinished({r.id for r in triage.runnable})
        log.error("job %s: %s", job.id, exc)  # the job's fault (the pair does not fit): the requests fail
        for request in triage.runnable:
            writer.add(GenerationResult.failed(request.id, str(exc)))
        return _Unfinished()
    if ctx.metrics is not None:
        ctx.metrics.set_compiled(writer.model, ctx.config.device, pair.compiled, pair.warm_up_s)
    _record_compiled(ctx, pair.compile_report())
    if training is None:
        return _run_requests(ctx, job, settings, pair, triage.runnable, triage.suspects, writer)
    unfinished = _run_requests(
        ctx, job, settings, pair, [r for r in triage.runnable if r.seq < training.prompts], triage.suspects, writer
    )
    rest = [r for r in triage.runnable if r.seq >= training.prompts]
    if rest:
        writer.flush()  # the first N's results stored: the training reads them
    if rest and not (writer.cancelled or ctx.shared.stopping.is_set()):
        from specq.worker.trained_draft import speculating_pair

        pair = speculating_pair(ctx, job, settings, pair)
    unfinished |= _run_requests(ctx, job, settings, pair, rest, triage.suspects, writer)
    return unfinished


def _run_requests(
    ctx: WorkerContext,
    job: Job,
    settings: JobSettings,
    pair: ModelPair,
    requests: list[ClaimedRequest],
    suspects: list[list[int]],
    writer: _Writer,
) -> _Unfinished:
    """Prepare `requests` and run them through `pair` group by group."""
    ready, failed = _prepare(ctx, pair, requests, settings)
    for result in failed:
        writer.add(result)
    injected = faults.installed()  # once per run, not per request
    unfinished = _Unfinished()
    for group in _groups(ready, suspects):
        if writer.cancelled or ctx.shared.stopping.is_set():
            unfinished.ids.update(p.claimed.id for p in group.requests)
        else:
            unfinished |= _generate_group(ctx, job, settings, pair, group, writer, injected)
    return unfinished


def _settle(
    ctx: WorkerContext, chunk: Chunk, unfinished: _Unfinished, cancelled: bool, started: set[int]
) -> dict[str, int]:
    """What the run left undone: cancelled with its job, else given back to the queue (the worker is
    stopping); the counts of that, for the task's log line. `started`: the chunk's requests this process
    counted started (their starts are taken back with a cancel: this worker did not die)."""
    counts = {"cancelled": 0, "released": 0}
    if unfinished.ids and cancelled:
        mine = sorted(unfinished.ids & started)
        with ctx.db.session() as session:
            counts["cancelled"] = cancel_claimed(session, chunk[0], sorted(unfinished.ids), ctx.config.name, mine)
    elif unfinished.ids:
        unstarted = sorted(unfinished.unstarted & unfinished.ids)
        counts["released"] = _give_back(ctx, chunk, sorted(unfinished.ids), unstarted)
    return counts


def _give_back(ctx: WorkerContext, chunk: Chunk, request_ids: list[int], unstarted: list[int]) -> int:
    """Put requests this stopping worker will not run back in the queue, and their chunk on the broker
    (before the commit, as the sweeper does). If that fails, their leases expire and a sweeper does it."""
    try:
        with ctx.db.session() as session:
            released = release_claimed(session, request_ids, unstarted, ctx.config.name)
            if released and ctx.config.broker is not None:
                from specq.jobs.enqueue import enqueue_chunks

                enqueue_chunks(ctx.config.broker, [chunk], identity(ctx.db))
    except Exception as exc:
        log.warning(
            "could not give back %d requests of job %s (%s); their leases will expire", len(request_ids), chunk[0], exc
        )
        return 0
    why = "cannot serve" if ctx.shared.unusable else "stopping"
    log.info("%s: gave %d requests of job %s back to the queue", why, released, chunk[0])
    return released


def _run_claimed(ctx: WorkerContext, job: Job, claimed: list[ClaimedRequest], chunk: Chunk) -> dict[str, int]:
    job_id, first, end = chunk
    log.info("job %s: claimed %d requests of chunk [%d, %d)", job_id, len(claimed), first, end)
    started = time.monotonic()
    writer = _Writer(ctx, job)
    if ctx.metrics is not None:
        waited = (utcnow() - writer.enqueued_at).total_seconds()
        for _ in claimed:
            ctx.metrics.queue_time.labels(writer.model, ctx.config.device).observe(waited)
    try:
        settings = JobSettings.from_stored(job.settings)
        unfinished = _run(ctx, job, settings, _triage(ctx, job, settings, claimed), writer)
    finally:
        writer.flush()
        _set_worker(ctx, WorkerState.IDLE, None, None)
    held = ctx.started & {c.id for c in claimed}
    ctx.started.difference_update(c.id for c in claimed)  # stored, or cancelled or given back below
    settled = _settle(ctx, chunk, unfinished, writer.cancelled, held)
    measured = ctx.models.measure_compiled_speedups()  # once per model and machine, the chunk stored first
    if measured is not None:
        pair, line = measured
        log.info("%s", line)
        if ctx.metrics is not None:
            ctx.metrics.set_compiled(writer.model, ctx.config.device, pair.compiled, pair.warm_up_s)
        _record_compiled(ctx, pair.compile_report())
    if ctx.metrics is not None:
        ctx.metrics.chunk_duration.labels(writer.model, ctx.config.device).observe(time.monotonic() - started)
    return {"claimed": len(claimed), "written": writer.written, **settled}


def _claim(ctx: WorkerContext, chunk: Chunk) -> tuple[Job, list[ClaimedRequest]] | None:
    """The job and the chunk's claims, now held by this worker (their leases renewed by the heartbeat);
    None when there is nothing to run: the job is gone or cancelled, or nothing is left to claim."""
    job_id, first, end = chunk
    shared = ctx.shared
    with shared.lock, ctx.db.session() as session:
        job = lock_job(session, job_id)  # a cancel or retry runs wholly before or after this claim
        if job is None:
            log.warning("job %s is gone; dropping chunk [%d, %d)", job_id, first, end)
            return None
        expire_if_due(session, job)
        if job.state in NOT_CLAIMABLE:
            return None
        claimed = claim_chunk(session, job_id, first, end, ctx.config.name, ctx.config.queue.lease_s)
        session.expunge(job)
        shared.holding = frozenset(c.id for c in claimed)
        shared.abandoned.pop(chunk, None)  # claimed again here (a retry): nothing to give back
    return (job, claimed) if claimed else None


def run_chunk(ctx: WorkerContext, job_id: str, first: int, end: int) -> dict[str, int]:
    """Process the requests of job `job_id` at positions [first, end) that are still to do.

    Returns counts for the task's log line: claimed, written (results stored), cancelled, released
    (given back to the queue because the worker is stopping).
    """
    nothing = {"claimed": 0, "written": 0, "cancelled": 0, "released": 0}
    if ctx.shared.stopping.is_set():
        return nothing  # a task delivered after SIGTERM: claim nothing, the message is acknowledged
    chunk = (job_id, first, end)
    claim = _claim(ctx, chunk)
    if claim is None:
        return nothing
    try:
        return _run_claimed(ctx, *claim, chunk)
    except SQLAlchemyError:
        ctx.shared.abandon(chunk)  # the task retries; meanwhile any worker may take these, once given back
        raise
    finally:
        ctx.shared.holding = frozenset()  # whatever happened, this process renews these leases no more


def run_chunk_patiently(
    ctx: WorkerContext, job_id: str, first: int, end: int, patience_s: float = 600.0
) -> dict[str, int]:
    """`run_chunk`, waiting out a database outage in place: retried after 1, 2, 4 ... 30 s while the
    database does not answer, for up to `patience_s` (then the error is raised) or until the worker is
    told to stop. Each try is complete or leaves nothing half-written, so a retry is always safe."""
    stopping = ctx.shared.stopping
    waited, delay, failing = 0.0, 1.0, False
    while True:
        try:
            counts = run_chunk(ctx, job_id, first, end)
        except (OperationalError, InterfaceError) as exc:
            if waited >= patience_s or stopping.is_set():
                raise
            if not failing:
                reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
                log.warning("job %s chunk [%d, %d): database unreachable (%s); waiting", job_id, first, end, reason)
                failing = True
            if stopping.wait(delay):
                raise
            waited, delay = waited + delay, min(30.0, delay * 2)
            continue
        if failing:
            log.warning("job %s chunk [%d, %d): database back after %.0fs", job_id, first, end, waited)
        return counts
