"""Tiny random Llama pairs for engine tests: fast on a CPU, with distributions sharp enough to matter."""

from __future__ import annotations

import copy
import weakref
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specq.decoding.proposer import Offer
from specq.decoding.stats import NGRAM

EOS = 1
BOS = 0


class IdTokenizer:
    """Decodes ids as space-separated numbers: enough for the engine (stop strings, text)."""

    eos_token_id: int | None = EOS
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


# Keyed by the model object itself, not id(model): a module freed by one test and a new one built at the
# same address by the next must not share references (a gemma2 test once read a llama's tokens so).
_REFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference_greedy(model, prompt: list[int], max_tokens: int, eos: int | None = EOS) -> list[int]:
    """The target's own greedy output at batch 1 (HF generate), EOS excluded. Memoised per model."""
    memo = _REFERENCES.setdefault(model, {})
    key = (tuple(prompt), max_tokens, eos)
    if key not in memo:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=BOS
        )[0, len(prompt) :].tolist()
        memo[key] = out[: out.index(eos)] if eos is not None and eos in out else out
    return memo[key]


TINY_CORPUS = (
    "def add(a, b):\n    return a + b\n\n"
    "def mul(a, b):\n    return a * b\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "for i in range(10):\n    print(i, 'hello, world')\n"
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.\n"
) * 4


def save_tiny_pair(root: Path) -> tuple[str, str]:
    """(target_dir, draft_dir) under `root`: a byte-level BPE tokenizer (320 tokens, with a chat template)
    and two tiny random Llamas, the draft a noisy copy of the target, as `from_pretrained` folders;
    seconds to build. The pair the queue tests and `benchmarks/load_run.py` run real workers on."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],  # ids 0 and 1: tiny_llama's BOS and EOS
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TINY_CORPUS], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<s>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    )
    target = tiny_llama(vocab=len(tokenizer), layers=2, hidden=64, seed=0, max_positions=256)
    draft = noisy_copy(target, scale=0.02, seed=1)
    dirs = []
    for name, model in (("target", target), ("draft", draft)):
        model.float().save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs.append(str(root / name))
    return dirs[0], dirs[1]


class RepeatLastToken:
    """A model-free proposer (`specq.decoding.proposer.Proposer`): k copies of each row's last token,
    proposed as a point mass (draft_probs one-hot), as prompt lookup or n-gram proposers do."""

    def __init__(self, max_k: int, vocab_size: int):
        self.max_k, self.vocab_size = max_k, vocab_size

    def admit(self, batch, admission, stats) -> None:
        pass

    def offer(self, batch, live, limits):
        lengths = np.zeros(batch.rows, np.int64)
        lengths[live] = np.minimum(limits[live], self.max_k)
        return Offer(lengths, np.full(batch.rows, NGRAM, np.int64))

    def propose(self, batch, k: int, num_draft_h, stats):
        last = batch.token_ids.gather(1, (batch.seq_lens - 1).unsqueeze(1))  # [rows, 1]
        draft_token_ids = last.expand(-1, k).contiguous()  # [rows, k]
        if batch.sampling.all_greedy:
            return draft_token_ids, None
        return draft_token_ids, torch.nn.functional.one_hot(draft_token_ids, self.vocab_size).float()

    def advance(self, batch, output_ids, emitted) -> None:
        pass

    def release(self, rows, rows_t) -> None:
        pass

    def resize(self, rows, capacity, keep) -> None:
        pass


def with_proposer(engine, proposer):
    """`engine` (built with a draft, so it speculates) with `proposer` in the draft model's place."""
    engine.proposer = proposer
    return engine
