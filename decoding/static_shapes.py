"""The static-shape decode path: a decode forward's shapes rounded to a few sizes, so that a CUDA graph
recorded once per shape serves a whole job.

An eager decode step on a GPU is launch-bound: a small model's forward is hundreds of kernels, each
a few microseconds of work behind its launch. gpt-fast, vLLM and SGLang decode through CUDA graphs,
which replay a recorded forward in one launch, but a graph is fixed to its shapes and to its
inputs' addresses. With static shapes (`DecodingConfig.static_shapes`, and always where a model's
forward was compiled with CUDA graphs, decoding/compiled.py):

- **rows**: the batch holds a power of two of rows, up to the batch size (`row_bucket`); rows with
  no request decode padding, as a finished row does until it is reused or dropped;
- **columns**: the KV capacity is a power of two of at least `MIN_CAPACITY` columns
  (`capacity_bucket`), and every step's attention reads all of it: each row's mask hides the columns
  past its length, so a step's shape does not change as its sequences lengthen. Rollback stays a
  length change;
- **tokens a row**: the target verifies k + 1 (K + 1 widths), the draft model steps one, and a draft
  model's catch-up pass is rounded up to a power of two (`width_bucket`);
- **prefill**: eager, as gpt-fast does: prompts come in every length, and a graph per prompt width
  would be a graph per request.

So a job's decode forwards take at most (row sizes) x (K + 1 + catch-up widths) x (capacities)
shapes, each recorded once. The KV buffers are marked as static inputs (a graph writes them in place)
and a model's cache is kept between the engines a worker builds (`lease_cache`): a new buffer for
every batch would re-record every graph.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from specq.decoding.kv_cache import RaggedKVCache

MIN_CAPACITY = 128  # columns: the smallest capacity, so short jobs share one size


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def row_bucket(rows: int, limit: int) -> int:
    """The rows a batch of `rows` requests holds: the next power of two, at most `limit` (the batch size,
    itself a size when it is not a power of two); at least `rows`."""
    return max(min(_next_power_of_two(rows), limit), rows)


def capacity_bucket(columns: int) -> int:
    """The KV capacity that holds `columns` tokens a row."""
    return _next_power_of_two(max(columns, MIN_CAPACITY))


def width_bucket(width: int) -> int:
    """Tokens a row a forward of `width` feeds, padded."""
    return _next_power_of_two(width)


@dataclass
class _Kept:
    cache: RaggedKVCache
    held: bool = False  # an engine decodes on it now


_KEPT: weakref.WeakKeyDictionary[Any, _Kept] = weakref.WeakKeyDictionary()  # model -> its kept cache


@contextmanager
def lease_cache(model: Any, num_layers: int) -> Iterator[RaggedKVCache]:
    """The static cache kept for `model`, while no other engine holds it; otherwise a fresh one (two
    engines decoding at once must not share buffers). Its buffers keep their addresses for as long
    as its shape does."""
    kept = _KEPT.get(model)
    if kept is None or kept.cache.num_layers != num_layers:
        kept = _KEPT[model] = _Kept(RaggedKVCache(num_layers, 0, 0, static=True))
    if kept.held:
        yield RaggedKVCache(num_layers, 0, 0, static=True)
        return
    kept.held = True
    try:
        yield kept.cache
    finally:
        kept.held = False


# models whose forward was compiled with CUDA graphs (decoding/compiled.py): they decode on static shapes
_CUDA_GRAPHED: weakref.WeakSet[Any] = weakref.WeakSet()


def mark_cuda_graphed(model: Any) -> None:
    _CUDA_GRAPHED.add(model)


def is_cuda_graphed(model: Any) -> bool:
    """Whether `model`'s forward replays CUDA graphs, so that it must decode on static shapes."""
    return model in _CUDA_GRAPHED
