"""Compiled forwards (`--compile auto|on|off`): a model's forward through `torch.compile`, checked
against its eager forward before it is trusted.

An eager decode step of a small model is mostly Python and operator dispatch (on a GPU, kernel
launches), not arithmetic: gpt-fast and vLLM decode through compiled graphs for that reason. Here the
whole forward is compiled, from the cache columns of a step's tokens to its logits (the attention masks
and position ids too: decoding/hf_model.py's `ColumnsForward`); on a CPU with SPECQ_COMPILE_REGIONS=1,
the model's repeated decoder layer instead, once for all its layers (decoding/compiled_regions.py: a
compile of one layer's cost whatever the depth, for a step that gains much less). The whole forward
is compiled with dynamic shapes where they vary: the k + 1 tokens a step verifies, the columns attention
reads and the cache's capacity from a model's first graph (every job varies them), the rows once they
have varied (a batch draining: torch's automatic dynamic shapes, which the regional compile takes for
every dimension), so the engine's ragged batches reuse a few graphs instead of compiling one per shape,
while a dimension that never varies (the one row of a batch-1 job) keeps static kernels. On the 2-core
CPU that made a decode step 2-10% faster than compiling every dimension dynamic (`python
benchmarks/compile_shapes.py`, docs/benchmark-log/2026-12.md, "Compiled forwards"). The per-row cache
(decoding/kv_cache.py) and its rollback are unchanged.

On CUDA (inductor) the forward is compiled with CUDA graphs too (`mode="reduce-overhead"`): an eager
step there is launch-bound, and a graph replays the whole forward in one launch. A graph is recorded
for each concrete shape, so a model compiled so decodes on static shapes (decoding/static_shapes.py):
a few row counts, KV capacities and widths, recorded once each, with its prefills eager.
SPECQ_CUDA_GRAPHS=0 compiles without them (an escape hatch; the shapes are then as on a CPU).

Start-up: a load compiles what every job runs first, a decode step of each model, and checks it against
the eager model on the engine's own cache: a model that does not compile (an operator the compiler
refuses, a backend that fails) or whose compiled logits differ from eager falls back to eager with one
warning naming it and the reason; with `on` that is a `ModelCompileError` instead. Prefills run the
eager model (decoding/hf_model.py's `RaggedLM`), on a CPU as on CUDA: a prefill is one forward a
request, with enough arithmetic a token to gain little compiled, and its graphs (one for each count of
rows, of kept logits and of prompt lengths) were half a load's compiles. The sizes every job varies (the
tokens a row a step feeds, the columns attention reads, the cache's capacity) are dynamic from a model's
first graph (`_VARYING_SOURCES`), so a load compiles one graph a model where it compiled one specialised
to the check's first sizes, dropped, and then the dynamic one. On the demo pair a first process printed
its start-up line after 41.8 CPU seconds where it took 90.8 before, a second after 10.5 where 18.2 (one
pinned thread; docs/benchmark-log/2026-12.md, "Start-up: eager prefills, one dynamic graph a model"),
the step's gain over eager kept. Every other graph (a step of one token behind a draft model, a draft
model's catch-up of several, several rows) is compiled lazily, by the forward that first needs it, so a
job never waits for graphs it does not take (`warm_up_decoding` compiles every kind up front, for a
benchmark that wants none of it in its clock). Everything runs in inference mode, as the engine does: a
graph traced outside it would not serve the engine. Compiled artefacts (inductor's FX graph and autotune
caches, AOT autograd's cache) are kept on disk in specq's data directory, in a folder per torch version,
unless TORCHINDUCTOR_CACHE_DIR says otherwise; their keys hold the graph's code and torch's, so a new
model or torch compiles afresh, and the next process on the machine traces its graphs but takes their
code from the cache. `CompileOutcome` counts the graphs a load compiled and how many of them came from
the cache.

`auto` compiles on CUDA (launch-bound eager steps, where the gain is largest); on a CPU, where the gain
depends on the model and the CPU and the compile costs a minute on a small machine, it follows the
measurement kept for the model on this machine (decoding/compile_speedups.py: interleaved rounds, a
rule on their spread). The measurement is made once, by the first `--compile on` process that finds
none, and read by every later load: `specq bench --compile on` at load, before anything is timed;
`specq run` once its output is written, and a worker once its chunk is stored, so that a job's first
tokens never wait for it (`load_pair(measure_at_load=False)`, `ModelPair.measure_compiled_speedups`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from specq.decoding.compile_speedups import (
    SpeedupMeasurement,
    decide,
    measure,
    record_measurement,
    recorded_measurement,
    speedup_key,
)
from specq.decoding.compiled_regions import RegionalForward, repeated_layers
from specq.decoding.hf_model import CausalLM, ColumnsForward, RaggedLM, Tokenizer, eager_forward
from specq.decoding.static_shapes import is_cuda_graphed, mark_cuda_graphed
from specq.decoding.types import GenerationRequest, SamplingParams
from specq.errors import ModelCompileError
from specq.limits import COMPILE_MODES

CompileMode = Literal["auto", "on", "off"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileOutcome:
    compiled: bool
    seconds: float = 0.0  # compiling and checking against eager at load (and measuring, where it did)
    reason: str = ""  # why the model runs eagerly, or why `auto` compiled it
    speedup: float | None = None  # eager over compiled time of a decode step: the kept measurement's median
    graphs: int = 0  # graphs compiled at load
    cached_graphs: int = 0  # of those, the graphs whose code came from inductor's on-disk cache
    measured_s: float = 0.0  # measuring the speedup (once per model and machine): of `seconds` where at load
    measurement: str = ""  # the kept measurement: its median and spread (compile_speedups.SpeedupMeasurement)
    region: str = ""  # what was compiled: "its LlamaDecoderLayer (run by 30 layers)", "its whole forward"

    def summary(self) -> str:
        if not self.compiled:
            return f"eager ({self.reason})"
        measured = f", {self.measured_s:.1f}s of it measuring" if self.measured_s else ""
        # auto's reason quotes the measurement it followed
        gain = f"; a decode step {self.measurement}" if self.measurement and not self.reason else ""
        why = f"; {self.reason}" if self.reason else ""
        what = f" {self.region}:" if self.region else ""
        return (
            f"compiled{what} {self.graphs} graphs in {self.seconds:.1f}s ({self.cached_graphs} from the cache"
            f"{measured}){gain}{why}"
        )


# Shapes the engine's decode steps feed a model: batch rows and tokens a step (1 and more each: dynamic
# shapes still specialise 0 and 1), the rows first static and then dynamic once they vary, for every
# model a process loads (ColumnsForward.forward is one function for all): past torch's default limit
# of 8 graphs for one function
RECOMPILE_LIMIT = 64


def compile_model(
    model: CausalLM,
    name: str,
    mode: CompileMode,
    backend: Any = None,
    first: FirstForwards | None = None,
    measure_at_load: bool = True,
) -> tuple[Any, CompileOutcome]:
    """`model` compiled (or as it is, when `mode` says so or it cannot be), and what happened; `first`:
    the forwards compiled and checked now (default: a target's, one row, behind a draft model).

    `backend`: torch.compile's; None: SPECQ_COMPILE_BACKEND, else inductor (`aot_eager` checks that a
    model captures without paying for code generation). A compile with a named backend measures the speedup once
    per model and machine (decoding/compile_speedups.py), for later `auto` loads: at load with
    `measure_at_load`, else where the caller says (`measure_compiled_speedup`: after a job's tokens)."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    device = next(model.parameters()).device
    if mode == "off":
        return model, CompileOutcome(False, reason="--compile off")
    backend = _backend(backend)
    first = first or FirstForwards()
    regional = device.type != "cuda" and _regions_wanted()
    layers = repeated_layers(model) if regional else None
    key = speedup_key(model, backend, regions=layers is not None) if isinstance(backend, str) else None
    kept = recorded_measurement(key) if key is not None else None
    why = ""
    if mode == "auto" and device.type != "cuda":  # auto on a CPU: what was measured here decides
        if kept is None:
            reason = (
                f"--compile auto on {device.type}: not measured on this machine yet (--compile on measures it once)"
            )
            log.info("the model %s runs eagerly: %s", name, reason)
            return model, CompileOutcome(False, reason=reason)
        decision = decide(kept)
        if not decision.compile:
            log.info("the model %s runs eagerly: --compile auto on %s, %s", name, device.type, decision.why)
            return model, CompileOutcome(
                False, reason=f"--compile auto on {device.type}: {decision.why}", speedup=kept.median
            )
        why = f"--compile auto on {device.type}: {decision.why}"
    _cache_compiled_artefacts()
    started = time.perf_counter()
    counted = _compile_counts()
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled: Any = model
    measured_s = 0.0
    try:
        cuda_graphs = device.type == "cuda" and backend == "inductor" and _cuda_graphs_wanted()
        if layers is not None:  # one decoder layer's graphs, run by every layer (decoding/compiled_regions.py)
            compiled = RegionalForward(model, layers, backend)
        else:  # the forward from cache columns: its masks and position ids are built inside the graph
            if not cuda_graphs:  # CUDA graphs record a graph per static shape (decoding/static_shapes.py)
                _dynamic_from_the_start()
            compiled = torch.compile(
                ColumnsForward(model), backend=backend, mode="reduce-overhead" if cuda_graphs else None
            )
        if cuda_graphs:
            mark_cuda_graphed(compiled)  # before its first forward: every cache it sees must be static
            _allow_a_graph_per_static_shape()
        with torch.inference_mode():  # as the engine decodes: graphs traced otherwise would not serve it
            problem = _check_first_forwards(model, compiled, first)
        if problem is None and kept is None and key is not None and measure_at_load:  # once per model and machine
            measuring = time.perf_counter()
            kept = measure_compiled_speedup(compiled, name, first, backend)
            measured_s = time.perf_counter() - measuring
    except Exception as exc:  # the compiler's own errors have no common base class
        problem = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")
    seconds = time.perf_counter() - started
    if problem is not None:
        if mode == "on":
            raise ModelCompileError(f"the model {name!r} cannot be compiled: {problem}")
        log.warning("the model %s runs eagerly: it cannot be compiled (%s)", name, problem)
        return model, CompileOutcome(False, seconds, problem)
    graphs, cached = (now - before for now, before in zip(_compile_counts(), counted, strict=True))
    outcome = CompileOutcome(
        True,
        seconds,
        why,
        speedup=None if kept is None else kept.median,
        graphs=graphs,
        cached_graphs=cached,
        measured_s=measured_s,
        measurement="" if kept is None else kept.describe(),
        region=_what_compiled(layers),
    )
    log.info("%s: %s", name, outcome.summary())
    return compiled, outcome


def measure_compiled_speedup(
    compiled: Any, name: str, first: FirstForwards, backend: Any = None
) -> SpeedupMeasurement | None:
    """Measure the decode steps of `compiled` (what `compile_model` made) against its eager model's and
    keep the measurement for later `auto` loads; None where one is kept already (a key is measured once)
    or the backend is not a named one. Outside any timed run: at load, or after a job's tokens."""
    backend = _backend(backend)
    if not isinstance(backend, str):
        return None
    model = eager_forward(compiled).model
    key = speedup_key(model, backend, regions=isinstance(compiled, RegionalForward))
    if recorded_measurement(key) is not None:
        return None
    with torch.inference_mode():
        measurement = _measure_speedup(model, compiled, first)
    record_measurement(key, name, measurement)
    log.info("%s: a decode step measured %s", name, measurement.describe())
    return measurement


def _what_compiled(layers: torch.nn.ModuleList | None) -> str:
    if layers is None:
        return "its whole forward"
    return f"its {type(layers[0]).__name__} (run by {len(layers)} layer{'s' * (len(layers) > 1)})"


def _backend(backend: Any) -> Any:
    return backend or os.environ.get("SPECQ_COMPILE_BACKEND") or "inductor"


def _regions_wanted() -> bool:
    """SPECQ_COMPILE_REGIONS=1: on a CPU, the decoder layer compiled once for all layers instead of the
    whole forward (decoding/compiled_regions.py): a fifth of the compile, and most of the step's gain
    lost (docs/benchmark-log/2026-12.md, "Start-up, regional compilation"), so not the default."""
    return os.environ.get("SPECQ_COMPILE_REGIONS", "0") == "1"


def _compile_counts() -> tuple[int, int]:
    """(graphs dynamo has compiled, graphs inductor took from its on-disk cache) in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], counters["inductor"]["fxgraph_cache_hit"]


@dataclass(frozen=True)
class FirstForwards:
    """The forwards a job runs first through a model, which a load compiles (and checks): after an eager
    prefill of `rows` rows (a compiled model's prefills run eagerly: decoding/hf_model.py), decode steps
    of each of `widths` tokens a row (a target verifying k + 1 tokens behind a draft model: 2 and more,
    one graph; alone: 1; a draft model: 1). Widths 1 and 2 and more are graphs apart (dynamic shapes
    specialise 1), as are one row and several. Other shapes compile when a job first takes them."""

    rows: int = 1
    widths: tuple[int, ...] = (2,)

    def __post_init__(self) -> None:
        if self.rows < 1 or not self.widths or min(self.widths) < 1:
            raise ValueError(f"a check needs a row and a width of at least 1, got {self}")


# times the check runs a step through the compiled model: a forward compiled with CUDA graphs runs its
# first call unrecorded, records on the second and replays from the third, and a replay must match
_CHECKED_CALLS = 3
_PROMPT = 6  # tokens of the check's longest prompt


def _check_first_forwards(model: CausalLM, compiled: Any, first: FirstForwards) -> str | None:
    """Run `first`'s forwards through both (each compiled step until it replays a recorded graph, on the
    same inputs and cache columns each time); what differs, or None.

    Each step runs twice, after (eager) prefills of two prompt lengths, at two cache lengths and
    capacities: the sizes a job varies are dynamic from a model's first graph (`_VARYING_SOURCES`), so
    the second run checks the one graph at other sizes, and compiles nothing."""
    outputs = []
    for calls, candidate in ((1, model), (_CHECKED_CALLS, compiled)):
        lm = RaggedLM(candidate, static=is_cuda_graphed(compiled))
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, lm.vocab_size, (first.rows, _PROMPT), generator=generator).to(lm.device)
        got = []
        # twice, each time another prompt length, cache capacity and cache length: what a job varies
        for shorter, room in ((2, 0), (0, 8)):
            cache = lm.new_cache(rows=first.rows, capacity=_PROMPT + sum(first.widths) + room)
            lengths = np.full(first.rows, _PROMPT - shorter)
            lengths[1:] -= 1  # ragged where there are rows to be so: right-padded prompts
            lm.prefill_rows(cache, np.arange(first.rows), prompts, lengths, lm.vocab_size)  # eager (RaggedLM)
            start = _PROMPT - shorter  # past the longest prompt
            for width in first.widths:
                columns = start + torch.arange(width, device=lm.device).expand(first.rows, width).contiguous()
                for _ in range(calls):  # each call writes the same keys and values into the same columns
                    step = lm.step(cache, prompts[:, :width], columns, start + width, lm.vocab_size)  # [rows, w, V]
                got.append(step.float())
                start += width
        outputs.append(got)
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    names = [f"{width}-token step" for width in first.widths] * 2
    for what, eager, mine in zip(names, *outputs, strict=True):
        gap = float((eager - mine).abs().max())
        if not gap <= tolerance:  # NaN too
            return f"its compiled {what} logits differ from eager by {gap:.3g}"
    return None


# The warm-up's requests: ragged prompts, most of them a random span and then that span again (so
# prompt lookup matches, and a pair without a draft model verifies several tokens a step too), and
# prompts of one and two tokens; decoded one row at a time and then three at a time, so that rows drain
# and new ones are admitted beside running ones
_WARM_UP_SPANS = (3, 5, 8, 4, 6, 2)
_WARM_UP_SHORT = (1, 2)
_WARM_UP_TOKENS = 4  # the first request's; each next one 3 more


def warm_up_decoding(target: Any, draft: Any, tokenizer: Tokenizer) -> float:
    """Seconds spent decoding a few requests through the engine with the (compiled) models, so that the
    graphs of every kind of step a job takes are made at load, not in a job's first steps: of one token
    and of several, over one row and several, for each model (prefills run eagerly). Without it a
    worker's first job paid for those compiles in its first steps, and the compile time reported left
    them out."""
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
    for batch_size in (1, 3):
        config = DecodingConfig(batch_size=batch_size, model_free=None if draft is not None else "ngram")
        for _ in SpeculativeEngine(target, tokenizer, draft, config).generate(requests):
            pass
    return time.perf_counter() - started


_TIMED_CONTEXT = 64  # tokens in the cache a timed step attends to


def _measure_speedup(model: CausalLM, compiled: Any, first: FirstForwards) -> SpeedupMeasurement:
    """Eager over compiled seconds of the decode steps `first` names (the graphs the check compiled, so
    measuring compiles nothing more), in interleaved rounds (compile_speedups.measure); each round's
    ratio the smallest over the steps."""
    per_step = []
    for width in first.widths:
        runs = _timed_steps((model, compiled), first.rows, width)
        for run in runs:  # untimed: a first call at a new cache length may still compile
            run()
        per_step.append(measure(runs).ratios)
    return SpeedupMeasurement(tuple(min(ratios) for ratios in zip(*per_step, strict=True)))


def _timed_steps(candidates: tuple[Any, ...], rows: int, width: int) -> list[Callable[[], float]]:
    """A timed step of each candidate on one cache, prefilled eagerly: the candidates are one model, so
    each step writes the same keys and values into the same columns."""
    static = any(is_cuda_graphed(candidate) for candidate in candidates)  # one cache, static for all
    lms = [RaggedLM(candidate, static=static) for candidate in candidates]
    eager = lms[0]
    # room past the step's columns, as a job's cache has and the check's had: a step that reads a whole
    # cache buffer is a graph of its own (a whole buffer is contiguous, a part of one is not)
    cache = eager.new_cache(rows=rows, capacity=2 * _TIMED_CONTEXT)
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


# The sizes every job varies, as dynamo names them in ColumnsForward.forward: the tokens a row a step
# feeds (a target verifies k + 1, k chosen step by step), the columns attention reads and the cache's
# capacity (each layer's keys and values, dimension 2). Dynamic from a model's first graph, a decode
# step is one graph where it was two (one specialised to the first sizes seen, then the dynamic one:
# torch's record of what varied is kept on disk only under a job id), and a job whose k + 1 differs
# from the load's takes the load's graph. Rows still start static, so a batch-1 job keeps kernels for
# its one row; a width of 1 (a draft model's step) is a graph of its own, as dynamo specialises 1.
_VARYING_SOURCES = (
    r"L\['input_ids'\]:1",
    r"L\['columns'\]:1",
    r"L\['kv_length'\]",
    r"L\['cache'\]\.plan\.kv_length",
    r"L\['cache'\]\.layers\[\d+\]\.keys:2",
    r"L\['cache'\]\.layers\[\d+\]\.values:2",
)


def _dynamic_from_the_start() -> None:
    """`_VARYING_SOURCES` marked dynamic for every graph this process traces (beside any the user set)."""
    import torch.compiler.config

    config = torch.compiler.config
    chosen = [source for source in config.dynamic_sources.split(",") if source.strip()]
    config.dynamic_sources = ",".join(dict.fromkeys([*chosen, *_VARYING_SOURCES]))


def _cuda_graphs_wanted() -> bool:
    """CUDA graphs on CUDA unless SPECQ_CUDA_GRAPHS=0: an escape hatch, should a model's graphs misbehave."""
    return os.environ.get("SPECQ_CUDA_GRAPHS", "1") != "0"


def _cache_compiled_artefacts() -> None:
    """Inductor's and AOT autograd's caches in specq's data directory, a folder per torch version: a new
    torch starts afresh, and the old folder can be deleted whole."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # torch writes its own default into the environment the first time it looks: only a folder that
    # someone else chose is kept
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        from specq.paths import data_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(data_dir() / "compiled" / f"torch-{torch.__version__}")
