"""Linear layers whose multi-token forwards read prepacked weights (oneDNN), for speculation on a CPU.

A speculative step's cost is a verify: the target's forward of K + 1 tokens. At the memory roofline it
costs what a one-token step does, since both read every weight once. PyTorch's CPU fp32 linear does not
get there: one token takes a matrix-vector kernel near the bandwidth floor, but a few tokens take a
general matrix multiply that packs the weight into its own layout on every call, reading and writing the
whole weight again. Measured on a 2-core AMD EPYC VM (2 threads, a 1536 x 8960 fp32 weight: 55 MB):

    tokens      1       2       5       8
    F.linear    2.6 ms  13 ms   16 ms   26 ms
    prepacked   4.9 ms  3.5 ms  6.2 ms  6.5 ms

So each layer keeps its weight for one-token forwards (a plain step, a draft model's steps, target-only
decoding at batch 1) and a copy packed once by oneDNN for every wider one (a verify, a batch): the copy
costs the weights' memory again, and turns a verify from several steps' time into about one and a half.
Outputs are the same function; only the order of the floating-point sums differs, as it already did
between the two PyTorch kernels.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# A hint to oneDNN's packing: the rows (tokens x batch) the packed weight is laid out for; any row count
# runs on it (measured alike from 2 to 16 rows)
PACK_ROWS_HINT = 5
_packed_forwards = True  # off inside `plain_linears()`


@contextlib.contextmanager
def plain_linears() -> Iterator[None]:
    """Every PackedLinear runs as a plain nn.Linear inside: for baselines that measure stock PyTorch on
    the same loaded model (bench/hf_baselines.py)."""
    global _packed_forwards
    saved, _packed_forwards = _packed_forwards, False
    try:
        yield
    finally:
        _packed_forwards = saved


def can_pack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether prepacking helps here: fp32 on a CPU whose PyTorch has oneDNN (bf16 goes through oneDNN's
    own kernels already; CUDA's GEMMs do not repack)."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward reads its own weight for one row and a oneDNN-packed copy for more.

    Inside torch.compile it is a plain linear (inductor has its own packing, and no lowering of this op's
    packed layout): a compiled model runs as it would have."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the weight is the given layer's, not a new one
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in], shared with the model's state (tied embeddings stay tied)
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS_HINT)

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedLinear:
        # oneDNN's packed layout has no storage to copy: the copy packs its own copy of the weight
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "packed"}, memo))
        clone.packed = torch.ops.mkldnn._reorder_linear_weight(clone.weight.detach(), PACK_ROWS_HINT)
        return clone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows == 1 or not _packed_forwards or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)  # [rows, in]
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")  # [rows, out]
        return out.reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: Any) -> int:
    """Replace every nn.Linear of `model` (in inference: its weights must not change after) by a
    PackedLinear; the number replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
