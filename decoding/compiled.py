"""Compiled forwards (`--compile auto|on|off`): a model's forward through `torch.compile`, checked
against its eager forward before it is trusted.

An eager decode step of a small model is mostly Python and operator dispatch (on a GPU, kernel
launches), not arithmetic: gpt-fast and vLLM decode through compiled graphs for that reason. Here the
whole Hugging Face forward is compiled with torch's automatic dynamic shapes: a graph is specialised
to the shapes it first sees, and a dimension turns symbolic once it has varied (the rows as a batch
drains, the k + 1 tokens a step verifies, the columns attention reads), so the engine's ragged batches
reuse a few graphs instead of compiling one per shape, while a dimension that never varies (the one
row of a batch-1 job) keeps static kernels. On the 2-core CPU that made a decode step 2-10% faster
than compiling every dimension dynamic (`python benchmarks/compile_shapes.py`, docs/benchmarks.md).
The per-row cache (decoding/kv_cache.py) and its rollback are unchanged.

Before a compiled model is used, a warm-up runs a ragged prefill and a decode step through it and
through the eager model, on the engine's own cache: a model that does not compile (an operator the
compiler refuses, a backend that fails) or whose compiled logits differ from eager falls back to eager
with one warning naming it and the reason; with `on` that is a `ModelCompileError` instead. The warm-up
also pays the compile before the first request. Compiled artefacts are cached on disk (inductor's
caches, in specq's data directory unless TORCHINDUCTOR_CACHE_DIR says otherwise), so the next process
pays far less.

`auto` compiles on CUDA (launch-bound eager steps, where the gain is largest) and not on CPU, where the
compile costs minutes on a small machine for a gain docs/benchmarks.md measures per model.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import torch

from specq.decoding.hf_model import CausalLM, RaggedLM
from specq.errors import ModelCompileError
from specq.limits import COMPILE_MODES

CompileMode = Literal["auto", "on", "off"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileOutcome:
    compiled: bool
    seconds: float = 0.0  # compiling and checking, in the warm-up
    reason: str = ""  # why the model runs eagerly ("" when compiled)


def wants_compile(mode: CompileMode, device: torch.device) -> bool:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


# Shapes the engine feeds a model: batch rows and tokens a step (1 and more each: dynamic shapes still
# specialise 0 and 1), prefill and step, each first static and then dynamic once it varies: a dozen or
# two graphs, past torch's default limit of 8 for one function
RECOMPILE_LIMIT = 64


def compile_model(model: CausalLM, name: str, mode: CompileMode, backend: Any = None) -> tuple[Any, CompileOutcome]:
    """`model` compiled (or as it is, when `mode` says so or it cannot be), and what happened.

    `backend`: torch.compile's; None: SPECQ_COMPILE_BACKEND, else inductor (`aot_eager` checks that a
    model captures without paying for code generation)."""
    device = next(model.parameters()).device
    if not wants_compile(mode, device):
        return model, CompileOutcome(False, reason=f"--compile {mode} on {device.type}")
    _cache_compiled_artefacts()
    started = time.perf_counter()
    backend = backend or os.environ.get("SPECQ_COMPILE_BACKEND") or "inductor"
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    compiled: Any = model
    try:
        compiled = torch.compile(model, backend=backend)
        problem = _warm_up(model, compiled)
    except Exception as exc:  # the compiler's own errors have no common base class
        problem = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}".rstrip(": ")
    seconds = time.perf_counter() - started
    if problem is None:
        log.info("compiled %s in %.1fs", name, seconds)
        return compiled, CompileOutcome(True, seconds)
    if mode == "on":
        raise ModelCompileError(f"the model {name!r} cannot be compiled: {problem}")
    log.warning("the model %s runs eagerly: it cannot be compiled (%s)", name, problem)
    return model, CompileOutcome(False, seconds, problem)


def _warm_up(model: CausalLM, compiled: Any) -> str | None:
    """Run a ragged prefill and a two-token step through both; what differs, or None."""
    outputs = []
    for candidate in (model, compiled):
        lm = RaggedLM(candidate)
        cache = lm.new_cache(rows=2, capacity=16)
        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, lm.vocab_size, (2, 6), generator=generator).to(lm.device)  # [2, 6]
        rows = torch.arange(2, device=lm.device)
        with torch.no_grad():
            prefill = lm.prefill(cache, rows, prompts, lm.vocab_size, keep=prompts.shape[1])  # [2, 6, V]
            lengths = torch.tensor([[6], [4]], device=lm.device)  # row 1 rolled back two tokens
            columns = lengths + torch.arange(2, device=lm.device)  # [2, 2]
            step = lm.step(cache, prompts[:, :2], columns, kv_length=8, vocab_size=lm.vocab_size)  # [2, 2, V]
        outputs.append((prefill.float(), step.float()))
    (eager_prefill, eager_step), (compiled_prefill, compiled_step) = outputs
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    for what, eager, got in (("prefill", eager_prefill, compiled_prefill), ("step", eager_step, compiled_step)):
        gap = float((eager - got).abs().max())
        if not gap <= tolerance:  # NaN too
            return f"its compiled {what} logits differ from eager by {gap:.3g}"
    return None


def _cache_compiled_artefacts() -> None:
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from specq.paths import data_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(data_dir() / "inductor")
