"""A prompt's head that a row of the batch already holds is not prefilled again: same tokens, less work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding.prefix_reuse import MIN_SHARED_TOKENS, HeldPrompts
from tests.tiny_models import IdTokenizer, reference_greedy


def _templated(count: int, head: int = 40, seed: int = 3) -> list[list[int]]:
    """`count` prompts of one `head`-token template, each with a tail of its own (1 to 9 tokens)."""
    generator = torch.Generator().manual_seed(seed)
    template = torch.randint(2, 64, (head,), generator=generator).tolist()
    return [
        template + torch.randint(2, 64, (int(length),), generator=generator).tolist()
        for length in torch.randint(1, 10, (count,), generator=generator)
    ]


def _held(*prompts: tuple[int, ...] | None) -> HeldPrompts:
    held = HeldPrompts()
    held.resize(len(prompts), None)
    for row, prompt in enumerate(prompts):
        if prompt is not None:
            held.record([row], [prompt])
    return held


def test_the_longest_held_head_is_lent_and_a_row_keeps_its_own_on_a_tie():
    head = tuple(range(2, 2 + MIN_SHARED_TOKENS + 4))
    held = _held((*head, 90, 91), (*head[:-2], 90), (*head, 92))
    prompt = (*head, 93, 94)
    holders, lengths = held.shared_heads(np.array([2]), [prompt])
    assert (holders.tolist(), lengths.tolist()) == ([2], [len(head)])  # rows 0 and 2 hold as much: its own
    holders, lengths = held.shared_heads(np.array([1]), [prompt])
    assert (holders.tolist(), lengths.tolist()) == ([0], [len(head)])


def test_a_head_stops_short_of_the_prompt_and_short_heads_are_not_lent():
    head = tuple(range(2, 2 + MIN_SHARED_TOKENS + 4))
    held = _held(head)
    _, lengths = held.shared_heads(np.array([1]), [head])  # the same prompt: its last token is run
    assert lengths.tolist() == [len(head) - 1]
    short = _held((*head[: MIN_SHARED_TOKENS - 1], 99))
    _, lengths = short.shared_heads(np.array([1]), [head])
    assert lengths.tolist() == [0]


def test_rows_being_refilled_lend_only_to_themselves_and_idle_rows_lend_nothing():
    head = tuple(range(2, 2 + MIN_SHARED_TOKENS + 4))
    held = _held((*head, 90), (*head, 91))
    # row 0 is refilled in the same admission as row 1: its columns are about to change
    holders, lengths = held.shared_heads(np.array([0, 1]), [(7,) * 30, (*head, 92)])
    assert holders.tolist() == [0, 1] and lengths.tolist() == [0, len(head)]
    held.forget_idle(np.array([1]))  # row 0 idles through the next step, over its first columns
    holders, lengths = held.shared_heads(np.array([2]), [(*head, 92)])
    assert holders.tolist() == [1]
    held.resize(1, np.array([1]))  # compacted: row 1 is now row 0
    assert held.prompts == [(*head, 91)]


def _requests(prompts, max_tokens=12):
    return [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=max_tokens, temperature=0.0))
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("static_shapes", [False, True])
@pytest.mark.parametrize("uses_draft", [False, True])
def test_templated_prompts_decode_as_the_target_alone_with_their_head_prefilled_once(
    target, draft, batch_size, static_shapes, uses_draft
):
    prompts = _templated(10)
    config = DecodingConfig(batch_size=batch_size, static_shapes=static_shapes, strict=True)
    engine = SpeculativeEngine(target, IdTokenizer(), draft if uses_draft else None, config)
    results = {r.key: r.token_ids for r in engine.generate(_requests(prompts))}
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_greedy(target, prompt, 12), f"prompt {i}"
    # all but the first admission's prompts (one per row) take the 40-token head from a row that holds it
    assert engine.stats.prompt_tokens_reused >= 40 * (len(prompts) - batch_size)
    assert engine.stats.prefill_tokens + engine.stats.prompt_tokens_reused == sum(map(len, prompts))


def test_prompts_without_a_long_shared_head_are_prefilled_whole(target):
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 64, (20,), generator=generator).tolist() for _ in range(6)]
    engine = SpeculativeEngine(target, IdTokenizer(), None, DecodingConfig(batch_size=2, strict=True))
    results = {r.key: r.token_ids for r in engine.generate(_requests(prompts))}
    assert engine.stats.prompt_tokens_reused == 0
    assert all(results[i] == reference_greedy(target, p, 12) for i, p in enumerate(prompts))
