"""The memory roofline of a decode forward: how far one batch-1 forward is from the hardware's floor.

At batch 1 a decode forward reads each weight it uses once and does little arithmetic per byte, so
it cannot take less than (weight bytes it reads) / (memory bandwidth). The bandwidth is the
machine's, measured here as copy bandwidth (bytes read plus written per second) over a buffer far
larger than any cache, so that the copies go to memory as the weights' reads do. `forward / floor`
then says how much of a forward is something other than reading weights: operator dispatch and
Python on a CPU, kernel launches on a GPU, attention over the cache, the logits.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from specq.decoding.hf_model import LAST_ONLY, RaggedLM

# Past a CPU's last-level cache and a GPU's L2 by far, so that a copy of it is bound by memory
BANDWIDTH_MIN_BYTES = 256 * 2**20
BANDWIDTH_COPIES = 5
CONTEXT_TOKENS = 64  # the cache a timed forward attends to: a short prompt's
FORWARD_WARMUP = 3
FORWARD_REPEATS = 20
# told each forward a timing has run (1 to FORWARD_WARMUP + repeats) and how many it runs: a 1.5B model's
# forwards on a CPU take a minute a width, so the benchmark's progress follows them
ForwardsDone = Callable[[int, int], None]


def _unheard(done: int, total: int) -> None:
    """A timing nobody follows."""


def eager_module(model: Any) -> Any:
    """The module under a `torch.compile` wrapper (decoding/compiled.py), or `model` itself."""
    return getattr(model, "_orig_mod", model)


def weight_bytes(model: Any) -> int:
    """Bytes of weights one batch-1 decode forward reads: every parameter and buffer, except that of the
    input embedding table only the token's row is read, while the output projection is read whole even
    when it is the embedding table itself (tied weights, stored once).

    Buffers count whole: a forward reads its rotary frequencies, and one it never reads is bytes, not
    megabytes."""
    module = eager_module(model)
    embedding = module.get_input_embeddings().weight
    output = module.get_output_embeddings().weight
    # tied weights share one storage: count each storage once
    stored = {t.data_ptr(): t.nbytes for t in (*module.parameters(), *module.buffers()) if t.numel()}
    total = sum(stored.values()) - embedding.nbytes + embedding.nbytes // embedding.shape[0]
    if output.data_ptr() == embedding.data_ptr():
        total += output.nbytes
    return total


def measure_bandwidth(device: torch.device | str, nbytes: int) -> float:
    """The device's memory bandwidth in bytes per second: bytes read plus written by `dst.copy_(src)`,
    median over a few copies, of a buffer of `nbytes` or BANDWIDTH_MIN_BYTES, whichever is larger."""
    device = torch.device(device)
    size = max(nbytes, BANDWIDTH_MIN_BYTES)
    # filled, not empty: untouched pages of a fresh CPU buffer read as one shared zero page, from cache
    source = torch.ones(size, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    destination.copy_(source)  # the first write faults the destination's pages in
    seconds = []
    for _ in range(BANDWIDTH_COPIES):
        _synchronize(device)
        started = time.perf_counter()
        destination.copy_(source)
        _synchronize(device)
        seconds.append(time.perf_counter() - started)
    return 2 * size / statistics.median(seconds)


def forward_floor_seconds(weight_bytes: int, bandwidth: float) -> float:
    """The least time a forward that reads `weight_bytes` can take at `bandwidth` bytes per second."""
    return weight_bytes / bandwidth


def decode_forward_seconds(
    model: Any,
    context: int = CONTEXT_TOKENS,
    repeats: int = FORWARD_REPEATS,
    width: int = 1,
    on_forward: ForwardsDone = _unheard,
) -> float:
    """Median seconds of one batch-1 decode forward of `width` new tokens (1: a plain step; K + 1: a
    verify of K draft tokens) over a `context`-token cache, as the engine runs it (decoding/hf_model.py's
    RaggedLM, in inference mode), after a warm-up.

    The eager module prefills the cache, so that a compiled `model` needs no graph for a prefill of
    this shape; every timed forward writes the same columns, so each sees the same cache."""
    lm = RaggedLM(model)
    cache = lm.new_cache(rows=1, capacity=context + width)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, lm.vocab_size, (1, context + width), generator=generator).to(lm.device)
    # [1, context + width]
    columns = torch.arange(context, context + width, device=lm.device).unsqueeze(0)  # [1, width]
    rows = torch.zeros(1, dtype=torch.long, device=lm.device)
    seconds = []
    with torch.inference_mode():
        RaggedLM(eager_module(model)).prefill(cache, rows, tokens[:, :context], lm.vocab_size, keep=LAST_ONLY)
        for done in range(1, FORWARD_WARMUP + repeats + 1):
            _synchronize(lm.device)
            started = time.perf_counter()
            lm.step(cache, tokens[:, context:], columns, context + width, lm.vocab_size)
            _synchronize(lm.device)
            seconds.append(time.perf_counter() - started)
            on_forward(done, FORWARD_WARMUP + repeats)
    return statistics.median(seconds[FORWARD_WARMUP:])


def forward_ms_by_width(
    model: Any,
    widths: range,
    repeats: int = FORWARD_REPEATS,
    follow: Callable[[int], ForwardsDone] = lambda width: _unheard,
) -> dict[int, float]:
    """Milliseconds of a batch-1 eager forward of each width in `widths` (1 to K + 1): how much more a
    verify of K draft tokens costs than a plain step. At the memory roofline it costs the same: both
    read every weight once. `follow(width)` is told each forward of that width's timing."""
    return {
        width: 1e3 * decode_forward_seconds(eager_module(model), repeats=repeats, width=width, on_forward=follow(width))
        for width in widths
    }


def measure_roofline(
    models: dict[str, Any], max_width: int = 1, reached: Callable[[str], None] = lambda line: None
) -> tuple[float, dict[str, Any]]:
    """(the machine's bandwidth in bytes per second, the roofline): the bandwidth measured once, then for
    each model (by its role: target, draft) its weight bytes, floor and batch-1 decode forward time,
    eager and, when the model is compiled, compiled; with `max_width` > 1, its eager forward's time at
    each width from 1 to `max_width` too (a verify of K draft tokens is K + 1 wide). `reached` is told
    each forward timed (`the target's eager forward at width 3: 7 of 23`)."""
    sizes = {role: weight_bytes(model) for role, model in models.items()}
    device = next(eager_module(next(iter(models.values()))).parameters()).device
    bandwidth = measure_bandwidth(device, max(sizes.values()))
    rows = []
    for role, model in models.items():

        def follow(width: int, kind: str = "eager", role: str = role) -> ForwardsDone:
            return lambda done, total: reached(f"the {role}'s {kind} forward at width {width}: {done} of {total}")

        floor = forward_floor_seconds(sizes[role], bandwidth)
        eager = decode_forward_seconds(eager_module(model), on_forward=follow(1))
        compiled = (
            None if eager_module(model) is model else decode_forward_seconds(model, on_forward=follow(1, "compiled"))
        )
        by_width = forward_ms_by_width(model, range(2, max_width + 1), follow=follow) if max_width > 1 else {}
        rows.append(
            {
                "model": role,
                "weight_bytes": sizes[role],
                "floor_ms": floor * 1e3,
                "eager_forward_ms": eager * 1e3,
                "eager_over_floor": eager / floor,
                "compiled_forward_ms": None if compiled is None else compiled * 1e3,
                "compiled_over_floor": None if compiled is None else compiled / floor,
                # width -> ms; width 1 is the eager forward above
                "eager_forward_ms_by_width": {1: eager * 1e3, **by_width} if by_width else None,
            }
        )
    return bandwidth, {"context_tokens": CONTEXT_TOKENS, "models": rows}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
