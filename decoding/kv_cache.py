"""A KV cache in which every row (sequence) has its own length, so each row is rolled back on its own.

Hugging Face's `DynamicCache` keeps one length for the whole batch: rolling back a row it rejected
draft tokens for would mean rolling back every row to the slowest one. Here the cache is a
preallocated buffer per layer, `[rows, kv_heads, capacity, head_dim]`; row b holds its tokens in
columns `[0, lengths[b])`, always starting at column 0 (no left padding), so its position ids are
its column indices, exactly as when that sequence is decoded alone.

A forward pass writes the new keys/values of row b at columns `lengths[b] + t` (an indexed
assignment, `index_put_`: a compiled forward does it in place, where `scatter_` made inductor copy
every layer's whole buffer each step, which grew a compiled step's time with the capacity), and the
attention mask lets query t of row b see columns `<= lengths[b] + t`. Rolling back row b by r
tokens is `lengths[b] -= r`: the stale columns are never seen again and get overwritten. Inputs can
be ragged (row b feeds n_b <= T real tokens, right-padded): the padding is written past the row's
new length, where it is masked out and later overwritten.

With static shapes (decoding/static_shapes.py) the buffers are marked as static inputs: a forward
compiled with CUDA graphs writes them in place at the addresses it was recorded with, instead of
being refused CUDA graphs for mutating an input.

The model reads this through the standard `Cache` interface (`update` per layer), so any Hugging
Face causal LM whose attention layers call `cache.update` and accept a prepared 4D mask works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass
class WritePlan:
    """Where the current forward pass writes, set by `RaggedKVCache.plan_*` before each forward."""

    columns: torch.Tensor | None  # [rows or n, T] column of each new token; None: a prefill from column 0
    rows: torch.Tensor | None  # [n] rows a prefill writes; None for all rows (a step)
    kv_length: int  # columns the attention reads


class RaggedLayer(CacheLayerMixin):
    # Every layer keeps all its columns, sliding-window ones included: the engine's 4D masks apply each
    # layer's window (decoding/hf_model.py), and a full row is what per-row rollback needs. transformers
    # reads `is_sliding` only to size masks it builds itself, which it never does for a prepared 4D mask.
    is_sliding = False
    is_croppable = False

    def __init__(self, owner: RaggedKVCache) -> None:
        super().__init__()
        self.owner = owner
        self._bases: tuple[torch.Tensor, ...] = ()  # static shapes: (keys, values) the views are of

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, head_dim = key_states.shape
        shape = (self.owner.num_rows, heads, self.owner.capacity, head_dim)
        self.keys = key_states.new_zeros(shape)  # [rows, kv_heads, capacity, head_dim]
        self.values = value_states.new_zeros((*shape[:3], value_states.shape[-1]))
        self.device = key_states.device
        self.is_initialized = True
        if self.owner.static:
            self._bases = (self.keys, self.values)
            self._view(self.owner.num_rows, self.owner.capacity)

    def _view(self, num_rows: int, capacity: int) -> None:
        """Static shapes: the layer's keys and values are the first rows and columns of buffers that only
        grow, so they keep their address (a view's is its buffer's) through every resize that fits."""
        self.keys, self.values = (base[:num_rows, :, :capacity] for base in self._bases)
        for view in (self.keys, self.values):
            torch._dynamo.mark_static_address(view)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [rows or n, kv_heads, T, head_dim]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self.owner.plan
        assert self.keys is not None and self.values is not None
        if plan.columns is None:
            # Prefill of fresh rows: they start at column 0 and attend only to themselves.
            width = key_states.shape[2]
            self.keys[plan.rows, :, :width] = key_states
            self.values[plan.rows, :, :width] = value_states
            return key_states, value_states
        if plan.rows is None:
            rows = torch.arange(key_states.shape[0], device=key_states.device).unsqueeze(1)  # [rows, 1]
        else:  # a prefill after the prefix its rows already hold
            rows = plan.rows.unsqueeze(1)  # [n, 1]
        # indexing dims 0 and 2 around a slice puts the indexed dims first: [rows, T, kv_heads, head_dim]
        self.keys[rows, :, plan.columns] = key_states.transpose(1, 2)
        self.values[rows, :, plan.columns] = value_states.transpose(1, 2)
        if plan.rows is not None:
            return self.keys[plan.rows, :, : plan.kv_length], self.values[plan.rows, :, : plan.kv_length]
        return self.keys[:, :, : plan.kv_length], self.values[:, :, : plan.kv_length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.plan.kv_length, 0

    def get_seq_length(self) -> int:
        return self.owner.plan.kv_length

    def get_max_length(self) -> int:
        return self.owner.capacity

    def resize(self, num_rows: int, capacity: int, keep_rows: torch.Tensor | None) -> None:
        """Keep `keep_rows` (in that order) in the first rows and grow to `num_rows` x `capacity`."""
        if not self.is_initialized:
            return
        if self.owner.static:
            self._resize_static(num_rows, capacity, keep_rows)
            return
        assert self.keys is not None and self.values is not None
        old_keys, old_values = self.keys, self.values
        if keep_rows is not None:
            old_keys, old_values = old_keys.index_select(0, keep_rows), old_values.index_select(0, keep_rows)
        kept, heads, old_capacity, _ = old_keys.shape
        if (kept, old_capacity) == (num_rows, capacity):
            self.keys, self.values = old_keys, old_values
            return
        self.keys = old_keys.new_zeros((num_rows, heads, capacity, old_keys.shape[-1]))
        self.values = old_values.new_zeros((num_rows, heads, capacity, old_values.shape[-1]))
        width = min(old_capacity, capacity)
        self.keys[:kept, :, :width] = old_keys[:, :, :width]
        self.values[:kept, :, :width] = old_values[:, :, :width]

    def _resize_static(self, num_rows: int, capacity: int, keep_rows: torch.Tensor | None) -> None:
        """As `resize`, in place where the buffers are large enough (a kept cache may come from a larger
        batch: rows past `num_rows` are idle); grown, at a new address, only where they are not."""
        if keep_rows is not None:
            for base in self._bases:
                base[: keep_rows.numel()] = base.index_select(0, keep_rows)  # gathered first, then written
        old_rows, _, old_capacity, _ = self._bases[0].shape
        if num_rows > old_rows or capacity > old_capacity:
            grown = []
            for base in self._bases:
                new = base.new_zeros(
                    (max(num_rows, old_rows), base.shape[1], max(capacity, old_capacity), base.shape[3])
                )
                new[:old_rows, :, :old_capacity] = base
                grown.append(new)
            self._bases = tuple(grown)
        self._view(num_rows, capacity)


class RaggedKVCache(Cache):
    """Per-row-length KV cache for one model. Row lengths live with the caller (the engine's batch)."""

    def __init__(self, num_layers: int, num_rows: int, capacity: int, *, static: bool = False) -> None:
        self.num_layers = num_layers
        self.num_rows = num_rows
        self.capacity = capacity
        self.static = static  # buffers marked as static inputs (decoding/static_shapes.py)
        self.plan = WritePlan(columns=None, rows=None, kv_length=0)
        super().__init__(layers=[RaggedLayer(self) for _ in range(num_layers)])

    def plan_prefill(self, rows: torch.Tensor, width: int) -> None:
        """The next forward writes `width` tokens into fresh `rows`, from column 0."""
        self.plan = WritePlan(columns=None, rows=rows, kv_length=width)

    def plan_extend(self, rows: torch.Tensor, columns: torch.Tensor, kv_length: int) -> None:
        """The next forward writes row rows[i]'s token t at `columns[i, t]` after a prefix the row already
        holds, for `rows` [n] alone; attention reads `kv_length` columns."""
        self.plan = WritePlan(columns=columns, rows=rows, kv_length=kv_length)

    def plan_step(self, columns: torch.Tensor, kv_length: int) -> None:
        """The next forward writes row b's token t at `columns[b, t]`; attention reads `kv_length` columns."""
        self.plan = WritePlan(columns=columns, rows=None, kv_length=kv_length)

    def copy_rows(self, source: torch.Tensor, target: torch.Tensor, width: int) -> None:
        """Rows `target` [m] take the first `width` columns of rows `source` [m]: a prompt prefilled once
        for several rows (a line's `n` choices), a held head (decoding/prefix_reuse.py). Every source is
        read before any target is written, so a row may be both."""
        for layer in self.layers:
            assert isinstance(layer, RaggedLayer)
            if layer.is_initialized:
                assert layer.keys is not None and layer.values is not None
                layer.keys[target, :, :width] = layer.keys[source, :, :width]
                layer.values[target, :, :width] = layer.values[source, :, :width]

    def zero_rows(self, rows: torch.Tensor) -> None:
        """Zero every column of `rows` [m] (in place: static buffers keep their address)."""
        for layer in self.layers:
            assert isinstance(layer, RaggedLayer)
            if layer.is_initialized:
                assert layer.keys is not None and layer.values is not None
                layer.keys[rows] = 0
                layer.values[rows] = 0

    def resize(self, num_rows: int, capacity: int, keep_rows: torch.Tensor | None = None) -> None:
        for layer in self.layers:
            assert isinstance(layer, RaggedLayer)
            layer.resize(num_rows, capacity, keep_rows)
        self.num_rows, self.capacity = num_rows, capacity
