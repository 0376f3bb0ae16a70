"""The draft's shape and first weights, from the target's.

The draft is a Llama (the family every Hugging Face stack loads and specq decodes exactly) with the
target's vocabulary, head size, RoPE base and special tokens. Its default size: an eighth of the
target's layers (at least one) and half its width. A draft's decode step costs about its share of
the target's weights, and on small targets the vocabulary dominates: SmolLM2-135M's embedding is 28M
of its 135M weights, so half the width halves the largest part of the draft's forward.

Its embedding and output head start from the target's, which trains faster than a random start
(DistillSpec and EAGLE reuse the target's): at the same width they are copied; narrower, they are
projected onto the top right-singular vectors of the target's matrix, the width-h subspace that keeps
most of it (the target's final norm folded into its head first, since the draft's starts at one).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from specq.distill.settings import DraftShape

if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

MIN_HIDDEN = 32


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def draft_config(target_config: Any, shape: DraftShape) -> LlamaConfig:
    """The draft's LlamaConfig: `shape` where given, else sized from the target."""
    from transformers import LlamaConfig

    text = _text_config(target_config)
    target_hidden = int(text.hidden_size)
    target_heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or target_hidden // target_heads)
    hidden = shape.hidden or max(MIN_HIDDEN, target_hidden // 2)
    # whole heads of the target's size, so RoPE rotates the same pairs; a width too narrow for one head gets
    # heads of half the size each time
    while hidden % head_dim and head_dim > 8:
        head_dim //= 2
    heads = max(1, hidden // head_dim)
    if heads * head_dim != hidden:
        raise ValueError(f"the draft's hidden size {hidden} is not a multiple of a head size of 8 or more")
    kv_ratio = max(1, target_heads // int(getattr(text, "num_key_value_heads", None) or target_heads))
    kv_heads = heads // kv_ratio if heads % kv_ratio == 0 and heads >= kv_ratio else heads
    target_intermediate = int(getattr(text, "intermediate_size", None) or 4 * target_hidden)
    intermediate = shape.intermediate or max(hidden, round(target_intermediate * hidden / target_hidden))
    layers = shape.layers or max(1, math.ceil(int(text.num_hidden_layers) / 8))
    rope_theta = _rope_theta(text)
    config = LlamaConfig(
        vocab_size=int(text.vocab_size),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(getattr(text, "max_position_embeddings", None) or 4096),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or 1e-5),
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        bos_token_id=_special(target_config, text, "bos_token_id"),
        eos_token_id=_special(target_config, text, "eos_token_id"),
        pad_token_id=_special(target_config, text, "pad_token_id"),
        tie_word_embeddings=bool(getattr(target_config, "tie_word_embeddings", False)),
    )
    return config


def _rope_theta(text: Any) -> float:
    parameters = getattr(text, "rope_parameters", None) or {}
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        return float(parameters["rope_theta"])
    return float(getattr(text, "rope_theta", None) or 10_000.0)


def _special(config: Any, text: Any, name: str) -> Any:
    value = getattr(text, name, None)
    return getattr(config, name, None) if value is None else value


def build_draft(target: PreTrainedModel, shape: DraftShape, seed: int) -> LlamaForCausalLM:
    """A new draft for `target` (fp32, on the target's device, in train mode), its embedding and head
    started from the target's."""
    import torch
    from transformers import LlamaForCausalLM

    config = draft_config(target.config, shape)
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(config).to(torch.float32)
    start_from_target(draft, target)
    return draft.to(target.device).train()


def start_from_target(draft: LlamaForCausalLM, target: PreTrainedModel) -> None:
    """The draft's embedding and output head from the target's: copied at the same width, else projected
    (module docstring). Rows past the smaller vocabulary keep their random start."""
    import torch

    target_embed = target.get_input_embeddings().weight.detach().float()  # [target vocab, target hidden]
    target_head = _folded_head(target)  # [target vocab, target hidden]
    width = draft.config.hidden_size
    with torch.no_grad():
        basis = _top_directions(target_embed, width)  # [target hidden, width]
        embed = draft.get_input_embeddings().weight  # [vocab, width]
        rows = min(embed.shape[0], target_embed.shape[0])
        embed[:rows] = (target_embed[:rows] @ basis).to(embed.device)
        if draft.config.tie_word_embeddings:
            return
        head_basis = _top_directions(target_head, width)  # [target hidden, width]
        head = draft.get_output_embeddings().weight  # [vocab, width]
        rows = min(head.shape[0], target_head.shape[0])
        head[:rows] = (target_head[:rows] @ head_basis).to(head.device)


def _folded_head(target: PreTrainedModel) -> torch.Tensor:
    """The target's output head with its final norm's per-channel weight multiplied in."""
    head = target.get_output_embeddings().weight.detach().float()  # [vocab, hidden]
    norm = getattr(getattr(target, "model", None), "norm", None)
    weight = getattr(norm, "weight", None)
    if weight is not None and weight.shape == head.shape[1:]:
        # Gemma's RMSNorm scales by (1 + weight); Llama's and most others' by weight
        scale = weight.detach().float() + (1.0 if "gemma" in str(target.config.model_type) else 0.0)
        head = head * scale
    return head


def _top_directions(matrix: torch.Tensor, width: int) -> torch.Tensor:
    """[hidden, width]: the identity's first columns when width == hidden, else the top `width`
    right-singular vectors of `matrix` ([rows, hidden]), or all of them padded with zeros when wider."""
    import torch

    hidden = matrix.shape[1]
    if width == hidden:
        return torch.eye(hidden, dtype=matrix.dtype, device=matrix.device)
    _, _, vh = torch.linalg.svd(matrix, full_matrices=False)  # vh: [hidden, hidden]
    basis = vh[: min(width, hidden)].T  # [hidden, min(width, hidden)]
    if width > hidden:
        basis = torch.cat([basis, basis.new_zeros(hidden, width - hidden)], dim=1)
    return basis
