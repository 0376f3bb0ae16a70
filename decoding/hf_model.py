"""What the engine needs of a model and a tokenizer, and how a Hugging Face causal LM provides it.

The engine drives each model through a `RaggedKVCache` (decoding/kv_cache.py): every forward pass
names, per row, the cache column each input token is written to. The 4D attention mask and the
position ids follow from those columns, so a row decodes exactly as it would in a batch of its own
(no left padding, position ids equal to column indices).

Each layer gets the mask of its own attention type, as the model's code builds it for a batch of
one (transformers' masking_utils): full (causal), sliding (a query sees its last `sliding_window`
columns, itself included) or chunked (a query sees the earlier columns of its own
`attention_chunk_size` chunk). The cache keeps every column for every layer, so a row rolls back
the same way whatever its layers' types; a sliding layer just never reads its old columns. Models
whose layers mix types take a dict of masks by type (as `generate` passes them); the others one mask.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from specq.decoding.kv_cache import RaggedKVCache
from specq.decoding.prefill_groups import PrefillCost, length_groups
from specq.decoding.static_shapes import is_cuda_graphed

LAST_ONLY = 1  # `keep` of a prefill whose logits nobody reads: the last position only


class CausalLM(Protocol):
    """The part of a Hugging Face causal LM (`PreTrainedModel`) the engine uses."""

    config: Any  # a `PretrainedConfig`: get_text_config(), _attn_implementation, eos_token_id

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def forward(self, *args: Any, **kwargs: Any) -> Any: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def get_output_embeddings(self) -> Any: ...


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the engine uses (it also reads `bos_token_id`, `eos_token_id`)."""

    def decode(
        self, token_ids: list[int], /, *, skip_special_tokens: bool, clean_up_tokenization_spaces: bool
    ) -> Any: ...  # the text: str


def decode(tokenizer: Tokenizer, token_ids: list[int]) -> str:
    """The completion's text exactly as its tokens spell it: no special tokens dropped, no spaces cleaned."""
    return tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


class ColumnsForward(torch.nn.Module):
    """A causal LM's forward from the cache columns its tokens are written to: the 4D attention masks
    and the position ids are built here from `columns`, so that a compiled forward (decoding/compiled.py
    compiles this module) builds them inside its graph. Eagerly they are a dozen small operations a
    step, a tenth of a compiled draft model's step on the 2-core CPU.

    The model's own attributes (`config`, `generate`, ...) are read through it, so a compiled one stands
    in for the model wherever the model is asked for."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model
        text_config = model.config.get_text_config()
        self.max_context = context_length(text_config)
        self.keeps_logits = _accepts(model, "logits_to_keep")  # can compute chosen positions' logits alone
        # transformers renamed `past_key_values` to `cache` during 5.x.
        self.cache_kwarg = "cache" if _accepts(model, "cache") else "past_key_values"
        # SDPA and flex take a boolean mask; the eager path adds the mask to the scores.
        self._additive_mask_dtype = (
            next(model.parameters()).dtype if getattr(model.config, "_attn_implementation", "sdpa") == "eager" else None
        )
        self.layer_types = attention_types(model)  # [num_layers]
        self._sliding_window = int(getattr(text_config, "sliding_window", None) or 0)
        self._chunk_size = int(getattr(text_config, "attention_chunk_size", None) or 0)

    def forward(
        self,
        input_ids: torch.Tensor,
        columns: torch.Tensor,
        kv_length: int,
        cache: RaggedKVCache,
        keep: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Logits of `input_ids` [rows, T] written at `columns` [rows, T] of `cache`, whose attention reads
        its first `kv_length` columns; with `keep`, of those positions alone where the model can."""
        kwargs: dict[str, Any] = {self.cache_kwarg: cache, "use_cache": True}
        if keep is not None and self.keeps_logits:
            kwargs["logits_to_keep"] = keep
        # Padding past a row's context gets a clamped position; its outputs are never used.
        positions = columns if kv_length <= self.max_context else columns.clamp(max=self.max_context - 1)
        masks = self._attention_masks(columns, kv_length)
        mask = masks if len(masks) > 1 else next(iter(masks.values()))
        return self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **kwargs).logits

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or name == "model":
                raise
            return getattr(self.model, name)

    def _attention_masks(self, columns: torch.Tensor, kv_length: int) -> dict[str, torch.Tensor]:
        """One 4D mask [rows, 1, T, kv_length] per attention type of the model's layers, for queries at
        `columns` [rows, T] over the first `kv_length` columns of each row."""
        query = columns.unsqueeze(-1)  # [rows, T, 1]
        key = torch.arange(kv_length, device=columns.device)  # [kv_length]
        causal = key <= query  # [rows, T, kv_length]
        masks: dict[str, torch.Tensor] = {}
        for layer_type in dict.fromkeys(self.layer_types):
            allowed = causal
            if layer_type == "sliding_attention":
                allowed = causal & (key > query - self._sliding_window)
            elif layer_type == "chunked_attention":
                allowed = causal & (key // self._chunk_size == query // self._chunk_size)
            masks[layer_type] = self._attention_mask(allowed.unsqueeze(1))
        return masks

    def _attention_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        dtype = self._additive_mask_dtype
        if dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )


def columns_forward(model: CausalLM) -> Any:
    """`model` driven by cache columns: itself when it is a `ColumnsForward`, compiled or not (what
    decoding/compiled.py makes), else one around it."""
    return model if isinstance(getattr(model, "_orig_mod", model), ColumnsForward) else ColumnsForward(model)


def eager_forward(model: CausalLM) -> ColumnsForward:
    """The uncompiled `ColumnsForward` of `model`, compiled or not."""
    module = getattr(model, "_orig_mod", model)
    return module if isinstance(module, ColumnsForward) else ColumnsForward(module)


class RaggedLM:
    """One causal LM driven through a `RaggedKVCache`; logits come back padded to a shared vocabulary.

    With `static` shapes (decoding/static_shapes.py; always for a model compiled with CUDA graphs) a
    step's attention reads the cache's whole capacity. A compiled model's prefills run its eager forward."""

    def __init__(self, model: CausalLM, static: bool = False) -> None:
        self.model = model
        self.cuda_graphed = is_cuda_graphed(model)
        self.static = static or self.cuda_graphed
        self._forward = columns_forward(model)
        # a compiled model's prefills run its own module: a prefill is a request's one forward and does
        # enough arithmetic a token to gain little from a compiled graph, whose compiles (a graph for each
        # count of rows, kept logits and prompt length, static and then dynamic) were half a load's
        self._prefill_forward = eager_forward(model) if hasattr(model, "_orig_mod") else self._forward
        self.device = next(model.parameters()).device
        text_config = model.config.get_text_config()
        self.num_layers: int = text_config.num_hidden_layers
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.max_context: int = self._prefill_forward.max_context
        self.keeps_logits: bool = self._prefill_forward.keeps_logits
        self.prefill_cost = PrefillCost(self.device)
        # the tap a draft head reads the model's final hidden states by (decoding/draft_head.py): after
        # `prefill_rows` it holds those of each row's last position, as its logits are returned
        self.hidden_tap: HiddenTap | None = None
        # a CUDA-graphed model's tap, installed before it was compiled (HiddenTap.on refuses a later one)
        self._graphed_tap = HiddenTap.of(model) if self.cuda_graphed else None

    def new_cache(self, rows: int, capacity: int) -> RaggedKVCache:
        return RaggedKVCache(self.num_layers, rows, capacity, static=self.static)

    def prefill(
        self,
        cache: RaggedKVCache,
        rows: torch.Tensor,
        input_ids: torch.Tensor,
        vocab_size: int,
        keep: torch.Tensor | int,
        starts: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Write the right-padded prompts `input_ids` [n, T] into cache `rows` [n]: from column 0, or where
        `starts` [n] says, after the first starts[i] columns that row rows[i] already holds (a prefix
        shared with an earlier prompt, decoding/prefix_reuse.py).

        Logits only at positions `keep` ([n, len(keep), vocab_size]; an int: the last `keep`) where the
        model can compute them alone; otherwise at every position ([n, T, vocab_size]).
        """
        width = input_ids.shape[1]
        offsets = torch.arange(width, device=input_ids.device)
        if starts is None:
            cache.plan_prefill(rows, width)
            # contiguous, as a step's columns are: a compiled forward then needs no graph for other strides
            columns = offsets.expand_as(input_ids).contiguous()  # [n, T]
        else:
            # a shorter row's padding goes past its prompt, and no further than the cache's last column
            columns = (torch.from_numpy(starts).to(input_ids.device).unsqueeze(1) + offsets).clamp_(
                max=cache.capacity - 1
            )  # [n, T]
            cache.plan_extend(rows, columns, min(int(starts.max()) + width, cache.capacity))
        return self._run(self._prefill_forward, cache, input_ids, columns, vocab_size, keep=keep)

    def prefill_rows(
        self,
        cache: RaggedKVCache,
        rows: np.ndarray,
        input_ids: torch.Tensor,
        lengths: np.ndarray,
        vocab_size: int,
        starts: np.ndarray | None = None,
        last_logits: bool = False,
    ) -> tuple[torch.Tensor | None, int]:
        """`prefill` of cache `rows` [n] (host) with input_ids[i, :lengths[i]] each ([n, T] right-padded,
        on the device; lengths [n] > 0), after starts[i] held columns where given, in groups of rows of
        similar length (decoding/prefill_groups.py). Returns each row's logits at its last input token
        ([n, vocab_size], with `last_logits`; else None) and the forwards run."""
        groups = length_groups(lengths, self.prefill_cost.overhead_tokens())
        picked: list[torch.Tensor] = []
        tap = self.hidden_tap if last_logits else None
        picked_hidden: list[torch.Tensor] = []
        for group in groups:
            width = int(lengths[group].max())
            group_t = torch.from_numpy(group).to(self.device)  # [g]
            last = lengths[group] - 1  # [g]
            # where the model computes chosen positions' logits alone: the rows' last ones only
            keep = np.unique(last) if last_logits else None  # [u] sorted
            group_starts = None if starts is None or not starts[group].any() else starts[group]
            with self.prefill_cost.timing(len(group) * width):
                logits = self.prefill(
                    cache,
                    torch.from_numpy(rows[group]).to(self.device),
                    input_ids[group_t, :width],
                    vocab_size,
                    keep=LAST_ONLY if keep is None else torch.from_numpy(keep).to(self.device),
                    starts=group_starts,
                )  # [g, u or width, V]
            if keep is not None:
                picked.append(_at_last(logits, keep, last))
                hidden = None if tap is None else tap.take()  # [g, u or width, H]
                if hidden is not None:
                    picked_hidden.append(_at_last(hidden, keep, last))
        if self.hidden_tap is not None:  # [n, 1, H] in `rows` order, or None: no prefill's state to read
            self.hidden_tap.latest = None
        if not last_logits:
            return None, len(groups)
        order = torch.from_numpy(np.argsort(np.concatenate(groups))).to(self.device)  # [n] back to `rows` order
        if self.hidden_tap is not None and len(picked_hidden) == len(groups):
            self.hidden_tap.latest = torch.cat(picked_hidden)[order].unsqueeze(1)
        return torch.cat(picked)[order], len(groups)

    def step(
        self, cache: RaggedKVCache, input_ids: torch.Tensor, columns: torch.Tensor, kv_length: int, vocab_size: int
    ) -> torch.Tensor:
        """Logits [rows, T, vocab_size] for `input_ids` [rows, T] written at `columns` [rows, T] of each row;
        attention reads the first `kv_length` columns (with static shapes: all of them)."""
        cache.plan_step(columns, cache.capacity if self.static else kv_length)
        return self._run(self._forward, cache, input_ids, columns, vocab_size)

    def _run(
        self,
        forward: Any,
        cache: RaggedKVCache,
        input_ids: torch.Tensor,
        columns: torch.Tensor,
        vocab_size: int,
        *,
        keep: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """`forward`'s logits, padded to `vocab_size`: at positions `keep` (see `prefill`), None: everywhere."""
        # in row-major strides: a compiled forward would take another graph for a strided view (a draft's
        # slice), and `contiguous()` keeps a one-row view's strides as they were; copied only then
        if input_ids.stride() != (input_ids.shape[1], 1):
            input_ids = input_ids.clone(memory_format=torch.contiguous_format)
        logits = forward(input_ids, columns, cache.plan.kv_length, cache, keep)
        if self.cuda_graphed and forward is self._forward:
            # a CUDA graph's outputs live in its memory pool, overwritten by its next replay: the hidden
            # states too, kept only where a head reads them
            logits = logits.clone()
            tap = self._graphed_tap
            if tap is not None and tap.latest is not None:
                tap.latest = tap.latest.clone() if tap is self.hidden_tap else None
        if logits.shape[-1] < vocab_size:  # a smaller vocabulary: the missing ids get probability 0
            logits = torch.nn.functional.pad(logits, (0, vocab_size - logits.shape[-1]), value=float("-inf"))
        return logits


def _at_last(outputs: torch.Tensor, keep: np.ndarray, last: np.ndarray) -> torch.Tensor:
    """Each row's output [g, ...] at its last position `last` [g], from a prefill's `outputs` [g, u or T, ...]
    at the positions `keep` [u] (sorted) it kept: a model that cannot keep chosen positions returned them all."""
    at = np.searchsorted(keep, last) if outputs.shape[1] == len(keep) else last
    return outputs[torch.arange(len(last), device=outputs.device), torch.from_numpy(at).to(outputs.device)]


def attention_types(model: CausalLM) -> list[str]:
    """Each layer's attention type as the model's own code masks it: "full_attention",
    "sliding_attention" or "chunked_attention".

    A config with `layer_types` names them (gemma2/3, cohere2, qwen2, llama4, gpt_oss, ministral). A
    config without them gives every layer one mask: sliding where the config sets a `sliding_window`
    and the model's code builds sliding masks (mistral, mixtral, phi3, starcoder2, qwen3_moe), else
    full; a `sliding_window` the code never reads changes nothing.
    """
    config = model.config.get_text_config()
    num_layers = int(config.num_hidden_layers)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        types = [str(t) for t in layer_types[:num_layers]]
    elif getattr(config, "sliding_window", None) and _builds_sliding_masks(model):
        types = ["sliding_attention"] * num_layers
    else:
        types = ["full_attention"] * num_layers
    if "sliding_attention" in types and not getattr(config, "sliding_window", None):
        raise ValueError("the model has sliding-window layers but its config sets no sliding_window")
    if "chunked_attention" in types and not getattr(config, "attention_chunk_size", None):
        raise ValueError("the model has chunked-attention layers but its config sets no attention_chunk_size")
    return types


def _builds_sliding_masks(model: CausalLM) -> bool:
    module = sys.modules.get(type(model).__module__)
    return module is not None and hasattr(module, "create_sliding_window_causal_mask")


_SIGNATURES: dict[type, set[str]] = {}


def _accepts(model: CausalLM, name: str) -> bool:
    # a compiled model's forward takes (*args, **kwargs): its own module's names what it accepts
    model = getattr(model, "_orig_mod", model)
    params = _SIGNATURES.get(type(model))
    if params is None:
        params = _SIGNATURES[type(model)] = set(inspect.signature(model.forward).parameters)
    return name in params


def _eos_token_ids(*sources: object) -> set[int]:
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


def eos_token_ids(model: CausalLM, tokenizer: Tokenizer) -> set[int]:
    """Every id that ends a sequence: the generation config's, the model config's and the tokenizer's."""
    return _eos_token_ids(getattr(model, "generation_config", None), model.config, tokenizer)


def context_length(text_config: Any) -> int:
    """The tokens a sequence may hold: the config's positions, unbounded where it names none."""
    return int(getattr(text_config, "max_position_embeddings", None) or 2**31)


def start_token_id(tokenizer: Tokenizer) -> int | None:
    """The token an empty prompt starts from: BOS, else EOS (GPT-2 style tokenizers have only that)."""
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return None


class HiddenTap:
    """The input of a target's LM head at its latest forward: the final hidden states [rows, T, H] of
    the positions whose logits it computed. One tap per target.

    A forward pre-hook on the LM head records them. torch.compile traces a hook that is there when it
    compiles into the graph (the states become one more output of it, no copy), but never sees one added
    later (dynamo does not guard on a module's hooks): `install` before compiling a target, as
    models/loading.py does for every target it loads, so a draft head reads a compiled target too."""

    _taps: ClassVar[weakref.WeakKeyDictionary[torch.nn.Module, HiddenTap]] = weakref.WeakKeyDictionary()

    def __init__(self, lm_head: torch.nn.Module) -> None:
        self.latest: torch.Tensor | None = None
        lm_head.register_forward_pre_hook(self._record)

    def _record(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self.latest = args[0]

    @classmethod
    def install(cls, target: CausalLM) -> HiddenTap:
        """The target's tap, installed now where it has none."""
        lm_head = target.get_output_embeddings()
        tap = cls._taps.get(lm_head)
        if tap is None:
            tap = cls._taps[lm_head] = cls(lm_head)
        return tap

    @classmethod
    def of(cls, target: CausalLM) -> HiddenTap | None:
        return cls._taps.get(target.get_output_embeddings())

    @classmethod
    def on(cls, target: CausalLM) -> HiddenTap:
        """The tap a draft head reads `target` by; ValueError where `target` was compiled without one,
        whose forwards would never record a state."""
        tap = cls.of(target)
        if tap is None and hasattr(target, "_orig_mod"):
            raise ValueError("the target was compiled before its hidden states were tapped (HiddenTap.install)")
        return tap or cls.install(target)

    def take(self) -> torch.Tensor | None:
        latest, self.latest = self.latest, None
        return latest
