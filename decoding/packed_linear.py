"""Linear layers that read prepacked weights (oneDNN) where those are faster, for decoding on a CPU.

A speculative step's cost is a verify: the target's forward of K + 1 tokens. At the memory roofline it
costs what a one-token step does, since both read every weight once. PyTorch's CPU fp32 linear does not
get there: one token takes a matrix-vector kernel near the bandwidth floor, but a few tokens take a
general matrix multiply that packs the weight into its own layout on every call, reading and writing the
whole weight again. Measured on a 2-core AMD EPYC VM (2 threads, a 1536 x 8960 fp32 weight: 55 MB):

    tokens      1       2       5       8
    F.linear    2.6 ms  13 ms   16 ms   26 ms
    prepacked   4.9 ms  3.5 ms  6.2 ms  6.5 ms

So each layer reads a copy packed once by oneDNN for every wider forward (a verify, a batch): the copy
costs the weights' memory again, and turns a verify from several steps' time into about one and a half.
On another 2-core AMD EPYC VM a session later (the same PyTorch; the models' real weights, which a
step reads cold from memory), one row went the other way for most shapes, and the whole models'
one-token forwards with it:

    one row (ms)        896x4864  151936x896  1536x8960  151936x1536  | 0.5B model  1.5B model
    F.linear            0.62      32.4        2.67       42.6         | 144         300
    prepacked           0.52      17.4        2.13       29.1         | 105         248

So which kernel a layer's one-row forward takes is measured when it is packed, once per weight shape
(`choose_one_row_kernels`): a matrix-vector kernel's speed against oneDNN's packed one depends on the
CPU and the shape, and a one-token forward is what target-only decoding and every draft forward run.
The plain weight stays for what cannot read the packed copy (torch.compile, training, tied embeddings).
Outputs are the same function; only the order of the floating-point sums differs, as it already did
between the two PyTorch kernels.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
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
    """An nn.Linear whose forward reads a oneDNN-packed copy of its weight for more than one row, and for
    one row where `one_row_packed` (measured faster for its shape: `choose_one_row_kernels`).

    Inside torch.compile it is a plain linear (inductor has its own packing, and no lowering of this op's
    packed layout): a compiled model runs as it would have."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: the weight is the given layer's, not a new one
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # [out, in], shared with the model's state (tied embeddings stay tied)
        self.bias = linear.bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS_HINT)
        self.one_row_packed = False

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedLinear:
        # oneDNN's packed layout has no storage to copy: the copy packs its own copy of the weight
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "packed"}, memo))
        clone.packed = torch.ops.mkldnn._reorder_linear_weight(clone.weight.detach(), PACK_ROWS_HINT)
        return clone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        plain = (rows == 1 and not self.one_row_packed) or not _packed_forwards
        if plain or torch.is_grad_enabled() or torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        return self.packed_forward(x.reshape(rows, self.in_features)).reshape(*x.shape[:-1], self.out_features)

    def packed_forward(self, flat: torch.Tensor) -> torch.Tensor:
        """[rows, in] -> [rows, out] on the packed weight."""
        return torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")


OneRowTimer = Callable[[PackedLinear], tuple[float, float]]  # a layer -> (plain seconds, packed seconds)


def time_one_row(layer: PackedLinear, repeats: int = 5) -> tuple[float, float]:
    """The fastest of `repeats` one-row forwards of `layer` on each kernel, interleaved, so that a busy
    neighbour slows both alike."""
    x = torch.randn(1, layer.in_features, dtype=layer.weight.dtype)  # [1, in]
    plain, packed = float("inf"), float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            F.linear(x, layer.weight, layer.bias)
            middle = time.perf_counter()
            layer.packed_forward(x)
            end = time.perf_counter()
            plain, packed = min(plain, middle - start), min(packed, end - middle)
    return plain, packed


def choose_one_row_kernels(model: Any, timer: OneRowTimer = time_one_row) -> int:
    """Give each PackedLinear of `model` the kernel `timer` measures faster for one row, once per weight
    shape (a 1.5B model has seven); the number of layers that take the packed one."""
    by_shape: dict[tuple[int, int, torch.dtype, bool], list[PackedLinear]] = {}
    for layer in model.modules():
        if isinstance(layer, PackedLinear):
            shape = (layer.out_features, layer.in_features, layer.weight.dtype, layer.bias is not None)
            by_shape.setdefault(shape, []).append(layer)
    packed_layers = 0
    for layers in by_shape.values():
        plain_s, packed_s = timer(layers[0])
        for layer in layers:
            layer.one_row_packed = packed_s < plain_s
        packed_layers += len(layers) if packed_s < plain_s else 0
    return packed_layers


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
