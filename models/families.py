"""Which model families specq decodes exactly, decided from a model's config alone (no weights).

The engine drives a model through its own per-row KV cache and per-row 4D attention masks
(decoding/hf_model.py), and rolls each row back on its own after every step. That fits any
transformer whose layers attend over the cached keys and values (full, sliding-window or chunked
attention, each masked per layer), and no model that carries recurrent state (Mamba-style SSMs,
linear attention, short convolutions): such state cannot be rolled back per row to the last
accepted token. This module is the one place that decision is made: the loader, submit's model
check and `specq run` all ask `why_unsupported`.
"""

from __future__ import annotations

from typing import Any

# The layer types (a config's `layer_types`) the engine masks itself, one mask per type.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})

# Families with recurrent state in some or all layers, refused by name before their code is imported.
# Most also say so in `layer_types` ("linear_attention", "conv", "hybrid") or in their class's
# `_is_stateful`, which are checked too; the list catches those that do not (lfm2, minimax).
RECURRENT_FAMILIES = frozenset(
    {
        "bamba",
        "falcon_h1",
        "falcon_mamba",
        "granitemoehybrid",
        "jamba",
        "kimi_linear",
        "lfm2",
        "lfm2_moe",
        "mamba",
        "mamba2",
        "minimax",
        "nemotron_h",
        "olmo_hybrid",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_text",
        "qwen3_next",
        "recurrent_gemma",
        "rwkv",
        "xlstm",
        "zamba",
        "zamba2",
    }
)

RECURRENT_REASON = (
    "it keeps recurrent state (state-space, linear-attention or convolution layers), "
    "which cannot be rolled back per row to the last accepted token"
)

# ALiBi built from a 2D padding mask: the model derives its position biases from the mask it is
# given, and the engine gives it per-row 4D masks instead.
ALIBI_FROM_MASK_REASON = (
    "its ALiBi position biases are computed from a 2D padding mask, which specq's per-row 4D masks replace"
)


def why_unsupported(config: Any) -> str | None:
    """None if specq decodes this model exactly, else one line naming the family and why not.

    `config`: a transformers `PretrainedConfig` (what `AutoConfig.from_pretrained` returns).
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = str(getattr(text_config, "model_type", None) or getattr(config, "model_type", "unknown"))
    if family in RECURRENT_FAMILIES or config.model_type in RECURRENT_FAMILIES:
        return f"{family} is not supported: {RECURRENT_REASON}"
    layer_types = getattr(text_config, "layer_types", None) or []
    others = sorted({str(t) for t in layer_types} - ATTENTION_LAYER_TYPES)
    if others:
        return f"{family} is not supported: it has {', '.join(others)} layers, and {RECURRENT_REASON}"
    if family == "bloom" or (family == "falcon" and getattr(text_config, "alibi", False)):
        return f"{family} is not supported: {ALIBI_FROM_MASK_REASON}"
    model_class = _causal_lm_class(config)
    if model_class is None:
        return f"{family} is not supported: it is not a causal language model that transformers can load"
    # transformers' own mark for models whose state assisted generation cannot roll back
    if getattr(model_class, "_is_stateful", False):
        return f"{family} is not supported: {RECURRENT_REASON}"
    return None


def _causal_lm_class(config: Any) -> Any:
    """The transformers class AutoModelForCausalLM builds for this config (importing that family only);
    None if it builds none."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    return None if name is None else getattr(transformers, name, None)


def attention_implementation(config: Any) -> str:
    """SDPA where the family's code supports it, else eager (gemma2 and gpt_oss: logit soft-capping
    and attention sinks; mpt: no SDPA path). Both take the engine's 4D masks."""
    return "sdpa" if getattr(_causal_lm_class(config), "_supports_sdpa", False) else "eager"
