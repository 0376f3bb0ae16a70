"""A prompt's head that a row of the batch already holds is not prefilled again: same tokens, less work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding.prefill_groups import PrefillCost
from specq.decoding.prefix_reuse import MIN_SHARED_TOKENS, HeldPrompts
from tests.tiny_models import IdTokenizer, reference_greedy


def _templated(count: int, head: int = 40, seed: int = 3, templates: int = 1) -> list[list[int]]:
    """`count` prompts of `templates` `head`-token templates in turn, each with a tail of its own (1 to 9
    tokens). With two, a row refilled with the other template's prompt takes its head from another row."""
    generator = torch.Generator().manual_seed(seed)
    heads = [torch.randint(2, 64, (head,), generator=generator).tolist() for _ in range(templates)]
    return [
        heads[i % templates] + torch.randint(2, 64, (int(length),), generator=generator).tolist()
        for i, length in enumerate(torch.randint(1, 10, (count,), generator=generator))
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
    assert holders.tolist() in ([0], [2]) and lengths.tolist() == [len(head)]


def test_a_head_stops_short_of_the_prompt_and_short_heads_are_not_lent():
    head = tuple(range(2, 2 + MIN_SHARED_TOKENS + 4))
    held = _held(head, None)
    _, lengths = held.shared_heads(np.array([1]), [head])  # the same prompt: its last token is run
    assert lengths.tolist() == [len(head) - 1]
    short = _held((*head[: MIN_SHARED_TOKENS - 1], 99), None)
    _, lengths = short.shared_heads(np.array([1]), [head])
    assert lengths.tolist() == [0]


def test_rows_being_refilled_lend_what_they_held_and_idle_rows_lend_nothing():
    head, other = tuple(range(2, 2 + MIN_SHARED_TOKENS + 4)), tuple(range(40, 40 + MIN_SHARED_TOKENS + 4))
    held = _held((*head, 90), (*other, 91), None)
    # rows 0 and 1 are refilled together, each with the other's template: they swap heads
    holders, lengths = held.shared_heads(np.array([0, 1]), [(*other, 92), (*head, 93)])
    assert holders.tolist() == [1, 0] and lengths.tolist() == [len(other), len(head)]
    held.forget_idle(np.array([1]))  # row 0 idles through the next step, over its first columns
    assert held.shared_heads(np.array([2]), [(*head, 92)])[1].tolist() == [0]
    holders, lengths = held.shared_heads(np.array([2]), [(*other, 92)])
    assert holders.tolist() == [1]
    held.resize(1, np.array([1]))  # compacted: row 1 is now row 0
    assert held.prompts == [(*other, 91)]


def test_the_lent_head_is_the_longest_any_row_holds_over_random_batches():
    """Against comparing each prompt with every held one: over random held prompts (a few heads in common,
    rows idle, refilled and compacted), each prompt's head is the longest any row holds, its row's own on a
    tie, and the row chosen holds it."""
    generator = np.random.default_rng(0)
    heads = [tuple(generator.integers(2, 6, 40).tolist()) for _ in range(3)]

    def prompt() -> tuple[int, ...]:
        head = heads[generator.integers(3)][: generator.integers(10, 41)]
        return (*head, *generator.integers(2, 6, generator.integers(0, 6)).tolist())

    held = _held(*(prompt() if generator.random() < 0.8 else None for _ in range(12)))
    for _ in range(200):
        rows = np.sort(generator.choice(len(held.prompts), generator.integers(1, 4), replace=False))
        prompts = [prompt() for _ in rows]
        holders, lengths = held.shared_heads(rows, prompts)
        for row, asked, holder, length in zip(rows, prompts, holders, lengths, strict=True):
            shared = [_head(asked, lent) if lent is not None else 0 for lent in held.prompts]
            longest = max(shared)
            expected = longest if longest >= MIN_SHARED_TOKENS else 0
            assert length == expected
            assert holder == row if length == 0 or shared[row] == longest else shared[holder] == longest
        held.record(rows.tolist(), prompts)
        if generator.random() < 0.3:
            held.forget_idle(np.flatnonzero(generator.random(len(held.prompts)) < 0.7))
        if generator.random() < 0.1:
            keep = np.sort(generator.permutation(len(held.prompts))[: len(held.prompts) - 1])
            held.resize(12, keep)


def _head(prompt: tuple[int, ...], held: tuple[int, ...]) -> int:
    """The longest common head of `prompt` and `held`, one token short of `prompt` at most: element by element."""
    length = 0
    while length < min(len(prompt) - 1, len(held)) and prompt[length] == held[length]:
        length += 1
    return length


def _requests(prompts, max_tokens=12):
    return [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=max_tokens, temperature=0.0))
        for i, p in enumerate(prompts)
    ]


@pytest.mark.parametrize(("batch_size", "templates"), [(1, 1), (3, 1), (3, 2)])
@pytest.mark.parametrize("static_shapes", [False, True])
@pytest.mark.parametrize("uses_draft", [False, True])
def test_templated_prompts_decode_as_the_target_alone_with_their_head_prefilled_once(
    target, draft, batch_size, templates, static_shapes, uses_draft, monkeypatch
):
    # refilled as soon as they end (no prefill's fixed cost measured): a row that idles through a step
    # has its first columns overwritten, and so lends nothing (decoding/engine.py, `_refill_due`)
    monkeypatch.setattr(PrefillCost, "overhead_seconds", lambda self: 0.0)
    prompts = _templated(10, templates=templates)
    config = DecodingConfig(batch_size=batch_size, static_shapes=static_shapes, strict=True)
    engine = SpeculativeEngine(target, IdTokenizer(), draft if uses_draft else None, config)
    results = {r.key: r.token_ids for r in engine.generate(_requests(prompts))}
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_greedy(target, prompt, 12), f"prompt {i}"
    # all but the first admission's prompts (one per row) take the 40-token head from a row that holds it:
    # their own, or with two templates, often another's
    assert engine.stats.prompt_tokens_reused >= 40 * (len(prompts) - batch_size)
    assert engine.stats.prefill_tokens + engine.stats.prompt_tokens_reused == sum(map(len, prompts))


def test_prompts_without_a_long_shared_head_are_prefilled_whole(target):
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 64, (20,), generator=generator).tolist() for _ in range(6)]
    engine = SpeculativeEngine(target, IdTokenizer(), None, DecodingConfig(batch_size=2, strict=True))
    results = {r.key: r.token_ids for r in engine.generate(_requests(prompts))}
    assert engine.stats.prompt_tokens_reused == 0
    assert all(results[i] == reference_greedy(target, p, 12) for i, p in enumerate(prompts))


@pytest.mark.parametrize(("batch_size", "templates"), [(1, 1), (3, 1), (3, 2)])
def test_the_draft_model_reads_a_held_head_once_and_drafts_as_if_it_read_every_prompt_whole(
    target, draft, batch_size, templates, monkeypatch
):
    # the output is the target's whatever the draft proposes, so what shows a wrong draft cache is what it
    # proposes: with k fixed, every draft token and its acceptance must be as with whole reads
    import specq.decoding.prefix_reuse as prefix_reuse

    prompts = _templated(12, seed=4, templates=templates)

    def drafted(reuse: bool):
        monkeypatch.setattr(prefix_reuse, "MIN_SHARED_TOKENS", MIN_SHARED_TOKENS if reuse else 10**9)
        config = DecodingConfig(batch_size=batch_size, fixed_k=True, num_speculative_tokens=3, strict=True)
        engine = SpeculativeEngine(target, IdTokenizer(), draft, config)
        reads = []  # each draft prefill's starts (None: from column 0)
        assert engine._draft_proposer is not None
        lm = engine._draft_proposer.lm
        read = lm.prefill

        def prefill(*args, **kwargs):
            reads.append(kwargs.get("starts"))
            return read(*args, **kwargs)

        monkeypatch.setattr(lm, "prefill", prefill)
        results = {r.key: r.token_ids for r in engine.generate(_requests(prompts))}
        stats = engine.stats
        return results, (stats.num_draft_tokens, stats.num_accepted_tokens, stats.accepted_per_position), reads

    whole, whole_counts, whole_starts = drafted(reuse=False)
    reused, reused_counts, reused_starts = drafted(reuse=True)
    assert reused == whole and reused_counts == whole_counts
    assert all(s is None for s in whole_starts)
    heads = [int(s.max()) for s in reused_starts if s is not None]
    assert len(heads) >= 3 and min(heads) >= 40
