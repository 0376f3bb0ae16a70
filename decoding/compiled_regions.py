"""Regional compilation: a model's repeated decoder layer compiled once, its code run by every layer.

Compiling a model's whole forward makes one graph of all its layers: dynamo traces every layer, and
inductor generates and C++-compiles code for every layer, so the compile grows with the depth (a
six-layer target took 111 s on the 2-core CPU, a 30-layer SmolLM2 much longer), and a second process
traces every layer again even when the code comes from the cache. The layers of a decoder are one
class with one code: compiled as a region of their own, with their weights as the graph's inputs (the
`torch.compile` default since torch 2.5 for modules), one layer's trace and code serve every layer,
and a model costs one layer's compile whatever its depth. The embedding, the masks, the rotary
embedding, the final norm and the output projection run eagerly around them: a handful of operations
a step, against a layer's dozens.

The price is at run time: a step enters the region once per layer, and each entry checks the region's
guards (its inputs' and weights' shapes, the cache's state), where a compiled whole forward checks
them once. On the 2-core CPU that took most of the gain: the demo target's decode step 1.05x eager's
speed against 1.76x for its whole forward, SmolLM2's 1.10x against 1.28x (with the guards skipped, an
unsafe setting measured only to find the cost, the demo target's rose to 1.27x). So it is opt-in,
SPECQ_COMPILE_REGIONS=1 (decoding/compiled.py); docs/benchmark-log/2026-12.md has the figures.

What would tell the layers apart is the cache: each layer calls `cache.update(..., layer_idx)`, and a
graph that read the layer's index would be specialised to it (a graph per layer, and a step that
checks every layer's guards). So each layer's region sees a cache of its own layer alone
(`OneLayerCache`), made outside the region, and never reads its index.

The layers' own `forward` dispatches: to the region while a `RegionalForward` runs the model, to the
layer's own code otherwise, so the same model still serves as the eager reference beside its compiled
forward (decoding/compiled.py checks one against the other) and as the eager forward of prefills after
a held prefix (decoding/hf_model.py's `RaggedLM`).
"""

from __future__ import annotations

import hashlib
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specq.decoding.hf_model import CausalLM, ColumnsForward

# the region a `RegionalForward` runs its layers through, while it runs (per thread: a worker's heartbeat
# thread never runs a model, but nothing here assumes so)
_running = threading.local()

_LAYER_INDEX = "_specq_layer_index"  # a layer's attribute, its index in the cache: it dispatches to regions


class OneLayerCache(Cache):
    """The cache of one layer, as that layer's attention reads it: whatever index the layer passes."""

    def __init__(self, layer: CacheLayerMixin) -> None:
        super().__init__(layers=[layer])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int = 0, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[0].update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[0].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:  # type: ignore[override]
        return self.layers[0].get_mask_sizes(query_length)


def repeated_layers(model: CausalLM) -> torch.nn.ModuleList | None:
    """The model's decoder layers: the longest list of modules of one class that the model names as a
    block never to split (transformers' `_no_split_modules`, its decoder layer class); None if it has none."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    found: torch.nn.ModuleList | None = None
    for module in model.modules():  # type: ignore[attr-defined]
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        kinds = {type(layer) for layer in module}
        if len(kinds) == 1 and next(iter(kinds)).__name__ in blocks and (found is None or len(module) > len(found)):
            found = module
    return found


def _run_layer(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """One decoder layer's own forward: what the region compiles, the layer (and its weights) an input."""
    return type(layer).forward(layer, *args, **kwargs)


def _layer_runner(layers: torch.nn.ModuleList) -> Callable[..., Any]:
    """`_run_layer` under a name of its own for the layers' class and shapes. Dynamo keeps which sizes
    varied (its automatic dynamic shapes, also on disk for the next process) by the compiled function's
    name and place: under one name for all, a draft's layer of another width would make the target's
    widths symbolic, and the other way round."""
    shapes = [(name, tuple(parameter.shape)) for name, parameter in layers[0].named_parameters()]
    digest = hashlib.sha256(repr(shapes).encode()).hexdigest()[:12]
    name = f"_run_{type(layers[0]).__name__}_{digest}"
    code = _run_layer.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, _run_layer.__globals__, name)


class RegionalForward(ColumnsForward):
    """`ColumnsForward` of a model whose decoder `layers` run through one compiled region. Its
    `_orig_mod` is the eager forward, as a `torch.compile`d module's is."""

    def __init__(self, model: CausalLM, layers: torch.nn.ModuleList, backend: Any) -> None:
        super().__init__(model)
        self._orig_mod = ColumnsForward(model)
        self.region = torch.compile(_layer_runner(layers), backend=backend)
        for index, layer in enumerate(layers):
            _dispatch_to_regions(layer, index)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        outer = getattr(_running, "region", None)
        _running.region = self.region
        try:
            return super().forward(*args, **kwargs)
        finally:
            _running.region = outer


def _dispatch_to_regions(layer: torch.nn.Module, index: int) -> None:
    """Route `layer`'s forward to the running region, with its own cache layer, while a `RegionalForward`
    runs; to its own code otherwise. Installed once per layer, whatever number of compiles; bound to the
    layer, so that a copy of the model dispatches its own layers."""
    if hasattr(layer, _LAYER_INDEX):
        return
    setattr(layer, _LAYER_INDEX, index)
    layer.forward = types.MethodType(_dispatching_forward, layer)


def _dispatching_forward(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    region = getattr(_running, "region", None)
    cache_kwarg = "cache" if "cache" in kwargs else "past_key_values"
    cache = kwargs.get(cache_kwarg)
    if region is None or cache is None:
        return type(layer).forward(layer, *args, **kwargs)
    kwargs[cache_kwarg] = OneLayerCache(cache.layers[getattr(layer, _LAYER_INDEX)])
    return region(layer, *args, **kwargs)
