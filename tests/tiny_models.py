"""Tiny random Llama pairs for engine tests: fast on a CPU, with distributions sharp enough to matter."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

EOS = 1
BOS = 0


class IdTokenizer:
    """Decodes ids as space-separated numbers: enough for the engine (stop strings, text)."""

    eos_token_id = EOS
    bos_token_id = BOS

    def decode(self, ids, **_kwargs) -> str:
        return "".join(f"<{i}>" for i in ids)


def tiny_llama(
    *,
    vocab: int = 64,
    layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    sharpness: float = 6.0,
    max_positions: int = 256,
) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=BOS,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)  # random init is near-uniform; sharpen so greedy paths are stable
    return model


def noisy_copy(model: LlamaForCausalLM, scale: float, seed: int = 1) -> LlamaForCausalLM:
    """A draft that agrees with `model` often but not always."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * scale)
    return draft


_REFERENCES: dict[tuple, list[int]] = {}


def reference_greedy(model, prompt: list[int], max_tokens: int, eos: int | None = EOS) -> list[int]:
    """The target's own greedy output at batch 1 (HF generate), EOS excluded. Memoised per model."""
    key = (id(model), tuple(prompt), max_tokens, eos)
    if key not in _REFERENCES:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=BOS
        )[0, len(prompt) :].tolist()
        _REFERENCES[key] = out[: out.index(eos)] if eos is not None and eos in out else out
    return _REFERENCES[key]
