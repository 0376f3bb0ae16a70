"""Compiled forwards (`--compile auto|on|off`): a model's forward through `torch.compile`, checked
against its eager forward before it is trusted.

An eager decode step of a small model is mostly Python and operator dispatch (on a GPU, kernel
launches), not arithmetic: gpt-fast and vLLM decode through compiled graphs for that reason. Here the
whole forward is compiled, from the cache columns of a step's tokens to its logits (the attention masks
and position ids too: decoding/hf_model.py's `ColumnsForward`), with torch's automatic dynamic shapes:
a graph is specialised to the shapes it first sees, and a dimension turns symbolic once it has varied
(the rows as a batch drains, the k + 1 tokens a step verifies, the columns attention reads), so the
engine's ragged batches reuse a few graphs instead of compiling one per shape, while a dimension that
never varies (the one row of a batch-1 job) keeps static kernels. On the 2-core CPU that made a decode
step 2-10% faster than compiling every dimension dynamic (`python benchmarks/compile_shapes.py`,
docs/benchmarks.md). The per-row cache (decoding/kv_cache.py) and its rollback are unchanged.

On CUDA (inductor) the forward is compiled with CUDA graphs too (`mode="reduce-overhead"`): an eager
step there is launch-bound, and a graph replays the whole forward in one launch. A graph is recorded
for each concrete shape, so a model compiled so decodes on static shapes (decoding/static_shapes.py):
a few row counts, KV capacities and widths, recorded once each, with its prefills eager.
SPECQ_CUDA_GRAPHS=0 compiles without them (an escape hatch; the shapes are then as on a CPU).

Before a compiled model is used, a warm-up runs a ragged prefill and a decode step through it and
through the eager model, on the engine's own cache: a model that does not compile (an operator the
compiler refuses, a backend that fails) or whose compiled logits differ from eager falls back to eager
with one warning naming it and the reason; with `on` that is a `ModelCompileError` instead. Once the
pair is compiled, `warm_up_decoding` decodes a few ragged requests through the engine, so that every
kind of graph a job takes is compiled at load, where its time is reported, and not in a job's first
steps. Everything runs in inference mode, as the engine does: a graph traced outside it would not
serve the engine. Compiled artefacts are cached on disk (inductor's caches, in specq's data directory
unless TORCHINDUCTOR_CACHE_DIR says otherwise), so the next process pays far less.

Every compile also times a decode step through both forwards, one row decoding one token and eight
rows verifying five, and keeps the smaller of the two speedups on disk (decoding/compile_speedups.py).
`auto` compiles on CUDA (launch-bound eager steps, where the gain is largest); on a CPU, where the gain
depends on the model and the CPU and the compile costs a minute or more on a small machine, it compiles
a model only where a compile on this machine measured it at least MIN_SPEEDUP faster, and keeps the
compiled forward only if the compile measures that again. So `--compile on` (a job, or `specq bench
--compile on`) measures a model once, and later `auto` runs follow what it measured.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from specq.decoding.compile_speedups import record_speedup, recorded_speedup, speedup_key
from specq.decoding.hf_model import CausalLM, ColumnsForward, RaggedLM, Tokenizer
from specq.decoding.static_shapes import is_cuda_graphed, mark_cuda_graphed
from specq.decoding.types import GenerationRequest, SamplingParams
from specq.errors import ModelCompileError
from specq.limits import COMPILE_MODES

CompileMode = Literal["auto", "on", "off"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileOutcome:
    compiled: bool
    seconds: float = 0.0  # compiling, checking against eager and timing a decode step
    reason: str = ""  # why the model runs eagerly ("" when compiled)
    speedup: float | None = None  # eager over compiled time of a decode step, as the compile measured it

    def summary(self) -> str:
        if self.compiled:
            return f"compiled in {self.seconds:.1f}s, a decode step {self.speedup:.2f}x eager's speed"
        return f"eager ({self.reason})"


# `auto` on a CPU compiles where a decode step measured at least this much faster compiled: below it the
# gain is inside the 2-core VM's run-to-run noise, and the compile itself is not free
MIN_SPEEDUP = 1.05


# Shapes the engine feeds a model: batch rows and tokens a step (1 and more each: dynamic shapes still
# specialise 0 and 1), prefill and step, each first static and then dynamic once it varies: a dozen or
# two graphs, past torch's default limit of 8 for one function
RECOMPILE_LIMIT = 64


def compile_model(model: CausalLM, name: str, mode: CompileMode, backend: Any = None) -> tuple[Any, CompileOutcome]:
    """`model` compiled (or as it is, when `mode` says so or it cannot be), and what happened.

    `backend`: torch.compile's; None: SPECQ_COMPILE_BACKEND, else inductor (`aot_eager` checks that a
    model captures without paying for code generation). A compile with a named backend keeps its
    measured speedup for later `auto` runs."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    device = next(model.parameters()).device
    if mode == "off":
        return model, CompileOutcome(False, reason="--compile off")
    backend = backend or os.environ.get("SPECQ_COMPILE_BACKEND") or "inductor"
    key = speedup_key(model, backend) if isinstance(backend, str) else None
    measured_only = mode == "auto" and device.type != "cuda"  # auto on a CPU: what was measured decides
    if measured_only:
        kept = recorded_speedup(key) if key is not None else None
        if kept is None or kept < MIN_SPEEDUP:
            measured = "not measured here yet" if kept is None else f"measured {kept:.2f}x here"
            log.info("the model %s runs eagerly: --compile auto on %s, compiled %s", name, device.type, measured)
            return model, CompileOutcome(False, reason=f"--compile auto on {device.type}: compiled {measured}")
    _cache_compiled_artefacts()
    started = time.perf_counter()
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled: Any = model
    speedup = 0.0
    try:
        cuda_graphs = device.type == "cuda" and backend == "inductor" and _cuda_graphs_wanted()
        # the forward from cache columns: its masks and position ids are built inside the graph
        forward = ColumnsForward(model)
        compiled = torch.compile(forward, backend=backend, mode="reduce-overhead" if cuda_graphs else None)
        if cuda_graphs:
            mark_cuda_graphed(compiled)  # before its first forward: every cache it sees must be static
            _allow_a_graph_per_static_shape()
        with torch.inference_mode():  # as the engine decodes: graphs traced otherwise would not serve it
            problem = _warm_up(model, compiled)
            if problem is None:
                speedup = _measure_speedup(model, compiled)
    except Exception as exc:  # the compiler's own errors have no common base class
        problem = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")
    seconds = time.perf_counter() - started
    if problem is not None:
        if mode == "on":
            raise ModelCompileError(f"the model {name!r} cannot be compiled: {problem}")
        log.warning("the model %s runs eagerly: it cannot be compiled (%s)", name, problem)
        return model, CompileOutcome(False, seconds, problem)
    if key is not None:
        record_speedup(key, name, speedup)
    if measured_only and speedup < MIN_SPEEDUP:
        log.info("the model %s runs eagerly: compiled, a decode step measured %.2fx eager's speed", name, speedup)
        return model, CompileOutcome(False, seconds, f"compiled {speedup:.2f}x eager's speed", speedup)
    outcome = CompileOutcome(True, seconds, speedup=speedup)
    log.info("%s: %s", name, outcome.summary())
    return compiled, outcome


# times the check runs its step through the compiled model: a forward compiled with CUDA graphs runs
# its first call unrecorded, records on the second and replays from the third, and a replay must match
_CHECKED_CALLS = 3


def _warm_up(model: CausalLM, compiled: Any) -> str | None:
    """Run a ragged prefill and a two-token step through both (the compiled step until it replays a
    recorded graph, on the same inputs and cache columns each time); what differs, or None."""
    outputs = []
    for calls, candidate in ((1, model), (_CHECKED_CALLS, compiled)):
        lm = RaggedLM(candidate, static=is_cuda_graphed(compiled))
        cache = lm.new_cache(rows=2, capacity=16)
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, lm.vocab_size, (2, 6), generator=generator).to(lm.device)  # [2, 6]
        rows = torch.arange(2, device=lm.device)
        prefill = lm.prefill(cache, rows, prompts, lm.vocab_size, keep=prompts.shape[1])  # [2, 6, V]
        lengths = torch.tensor([[6], [4]], device=lm.device)  # row 1 rolled back two tokens
        columns = lengths + torch.arange(2, device=lm.device)  # [2, 2]
        for _ in range(calls):  # each call writes the same keys and values into the same columns
            step = lm.step(cache, prompts[:, :2], columns, kv_length=8, vocab_size=lm.vocab_size)  # [2, 2, V]
        outputs.append((prefill.float(), step.float()))
    (eager_prefill, eager_step), (compiled_prefill, compiled_step) = outputs
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    for what, eager, got in (("prefill", eager_prefill, compiled_prefill), ("step", eager_step, compiled_step)):
        gap = float((eager - got).abs().max())
        if not gap <= tolerance:  # NaN too
            return f"its compiled {what} logits differ from eager by {gap:.3g}"
    return None


# The warm-up's requests: ragged prompts, most of them a random span and then that span again (so
# prompt lookup matches, and a pair without a draft model verifies several tokens a step too), and
# prompts of one and two tokens (a prefill that attends to one column); decoded one row at a time and
# then three at a time, so that rows drain and new ones are admitted beside running ones
_WARM_UP_SPANS = (3, 5, 8, 4, 6, 2)
_WARM_UP_SHORT = (1, 2)
_WARM_UP_TOKENS = 4  # the first request's; each next one 3 more


def warm_up_decoding(target: Any, draft: Any, tokenizer: Tokenizer) -> float:
    """Seconds spent decoding a few requests through the engine with the (compiled) models, so that the
    graphs of every kind of forward a job takes are made at load, not in a job's first steps: prefills
    of one row and of several, of one prompt length and of several; steps of one token and of several,
    over one row and several, for each model. Without it a worker's first job paid for those compiles
    in its first steps, and the compile time reported left them out."""
    from specq.decoding.config import DecodingConfig
    from specq.decoding.engine import SpeculativeEngine

    started = time.perf_counter()
    generator = torch.Generator().manual_seed(2)
    vocab_size = RaggedLM(target).vocab_size
    spans = [torch.randint(0, vocab_size, (span,), generator=generator).tolist() for span in _WARM_UP_SPANS]
    short = [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in _WARM_UP_SHORT]
    prompts = [spans[0] * 2, *short, *(span * 2 for span in spans[1:])]
    # lengths apart, so that rows finish at different steps and are replaced one at a time
    requests = [
        GenerationRequest(key, tuple(prompt), SamplingParams(max_tokens=_WARM_UP_TOKENS + 3 * key, temperature=0.0))
        for key, prompt in enumerate(prompts)
    ]
    # then rows that end at their prefill, so that two are refilled at once into a cache in use: the rows
    # above end one at a time, and that prefill of several rows would compile a graph in a job; two of
    # one length and two of another, as a prefill of rows of one length (decoding/prefill_groups.py)
    # keeps one position's logits
    alike = [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for length in _WARM_UP_SHORT]
    ended = [
        GenerationRequest(len(requests) + key, tuple(prompt), SamplingParams(max_tokens=1, temperature=0.0))
        for key, prompt in enumerate([short[0], alike[0], short[1], alike[1], *short])
    ]
    for batch_size, batch in ((1, requests), (3, requests), (2, [*ended, *requests[:2]])):
        config = DecodingConfig(batch_size=batch_size, model_free=None if draft is not None else "ngram")
        for _ in SpeculativeEngine(target, tokenizer, draft, config).generate(batch):
            pass
    for model in (target, draft):
        if model is not None:
            _warm_up_prefill_groups(RaggedLM(model), generator)
    return time.perf_counter() - started


# A prefill's rows run in groups of similar length, split by the measured cost of a forward
# (decoding/prefill_groups.py), so which groups a job's prefills take varies from run to run: every kind,
# (rows, their prompt lengths), as the first prefill into a new cache and into one in use, keeping the
# rows' last logits (the target) or none (the draft model)
_GROUP_SHAPES = ((1, (1,)), (1, (3,)), (2, (1, 1)), (2, (3, 3)), (2, (2, 3)))


def _warm_up_prefill_groups(lm: RaggedLM, generator: torch.Generator) -> None:
    with torch.inference_mode():
        for last_logits in (True, False):
            for first in _GROUP_SHAPES:
                cache = lm.new_cache(2, 16)
                for rows, lengths in (first, *_GROUP_SHAPES):
                    lengths_h = np.array(lengths)
                    ids = torch.randint(0, lm.vocab_size, (rows, int(lengths_h.max())), generator=generator)
                    lm.prefill_rows(
                        cache, np.arange(rows), ids.to(lm.device), lengths_h, lm.vocab_size, last_logits=last_logits
                    )


# decode steps timed for the speedup: (rows, tokens a row) over a cache of _TIMED_CONTEXT tokens
_TIMED_STEPS = ((1, 1), (8, 5))
_TIMED_CONTEXT = 64
_TIMED_REPEATS = 7


def _measure_speedup(model: CausalLM, compiled: Any) -> float:
    """Eager over compiled seconds of a decode step, the smaller over `_TIMED_STEPS`: medians of runs
    taken in turns, so a slow spell of the machine slows both alike."""
    speedups = []
    for rows, width in _TIMED_STEPS:
        runs = _timed_steps((model, compiled), rows, width)
        samples: list[list[float]] = [[] for _ in runs]
        for _ in range(_TIMED_REPEATS + 1):  # the first of each: a compile of the new shape, not timed
            for run, times in zip(runs, samples, strict=True):
                times.append(run())
        eager, fast = (statistics.median(times[1:]) for times in samples)
        speedups.append(eager / fast)
    return min(speedups)


def _timed_steps(candidates: tuple[Any, ...], rows: int, width: int) -> list[Callable[[], float]]:
    """A timed step of each candidate on one cache, prefilled eagerly: the candidates are one model, so
    each step writes the same keys and values into the same columns."""
    static = any(is_cuda_graphed(candidate) for candidate in candidates)  # one cache, static for all
    lms = [RaggedLM(candidate, static=static) for candidate in candidates]
    eager = lms[0]
    cache = eager.new_cache(rows=rows, capacity=_TIMED_CONTEXT + width)
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, eager.vocab_size, (rows, _TIMED_CONTEXT), generator=generator).to(eager.device)
    eager.prefill(cache, torch.arange(rows, device=eager.device), prompts, eager.vocab_size, keep=1)
    tokens = prompts[:, :width]  # [rows, width]
    columns = _TIMED_CONTEXT + torch.arange(width, device=eager.device).expand(rows, width).contiguous()  # [rows, w]
    synchronize = torch.cuda.synchronize if eager.device.type == "cuda" else (lambda: None)

    def timed(lm: RaggedLM) -> Callable[[], float]:
        def run() -> float:
            synchronize()
            started = time.perf_counter()
            lm.step(cache, tokens, columns, kv_length=_TIMED_CONTEXT + width, vocab_size=lm.vocab_size)
            synchronize()
            return time.perf_counter() - started

        return run

    return [timed(lm) for lm in lms]


# graphs a forward records before torch warns of too many: one per static shape (decoding/static_shapes.py),
# rows sizes x widths x capacities, about a hundred at K = 8 and a batch of 32
_STATIC_SHAPES_RECORDED = 256


def _allow_a_graph_per_static_shape() -> None:
    import torch._inductor.config

    triton = torch._inductor.config.triton
    limit = triton.cudagraph_dynamic_shape_warn_limit
    if limit is not None:
        triton.cudagraph_dynamic_shape_warn_limit = max(limit, _STATIC_SHAPES_RECORDED)


def _cuda_graphs_wanted() -> bool:
    """CUDA graphs on CUDA unless SPECQ_CUDA_GRAPHS=0: an escape hatch, should a model's graphs misbehave."""
    return os.environ.get("SPECQ_CUDA_GRAPHS", "1") != "0"


def _cache_compiled_artefacts() -> None:
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from specq.paths import data_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(data_dir() / "inductor")
