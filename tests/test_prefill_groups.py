"""A prefill runs rows of similar length together: the cheapest split, its measured cost, and decoding
that the split leaves unchanged (decoding/prefill_groups.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding.hf_model import RaggedLM
from specq.decoding.prefill_groups import DEFAULT_OVERHEAD_TOKENS, PrefillCost, length_groups
from tests.tiny_models import IdTokenizer, reference_greedy


def _cost(lengths: np.ndarray, groups: list[np.ndarray], overhead: float) -> float:
    return sum(overhead + len(group) * int(lengths[group].max()) for group in groups)


def _partitions(items: list[int]):
    """Every partition of `items` into non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for smaller in _partitions(rest):
        for i in range(len(smaller)):
            yield [*smaller[:i], [first, *smaller[i]], *smaller[i + 1 :]]
        yield [[first], *smaller]


def test_the_groups_are_the_cheapest_split_of_the_rows():
    rng = np.random.default_rng(0)
    for _ in range(40):
        count = int(rng.integers(1, 8))
        lengths = rng.integers(1, 200, count)
        overhead = float(rng.choice([1, 16, 64, 300]))
        groups = length_groups(lengths, overhead)
        assert sorted(np.concatenate(groups).tolist()) == list(range(count))
        cheapest = min(
            _cost(lengths, [np.array(group) for group in partition], overhead)
            for partition in _partitions(list(range(count)))
        )
        assert _cost(lengths, groups, overhead) == cheapest


def test_a_forward_dearer_than_the_padding_keeps_one_group_and_like_lengths_share_one():
    lengths = np.array([5, 80, 7, 80, 6])
    assert [group.tolist() for group in length_groups(lengths, 1000.0)] == [[0, 4, 2, 1, 3]]
    assert [sorted(lengths[group].tolist()) for group in length_groups(lengths, 8.0)] == [[5, 6, 7], [80, 80]]


def test_the_fit_finds_a_forwards_overhead_in_tokens():
    cost = PrefillCost(torch.device("cpu"))
    for tokens in (100, 400, 900):
        assert cost.overhead_tokens() == DEFAULT_OVERHEAD_TOKENS  # too few prefills timed yet
        cost.record(tokens, 0.005 + 0.0001 * tokens)
    cost.record(1600, 0.005 + 0.0001 * 1600)
    assert cost.overhead_tokens() == pytest.approx(50.0)
    assert cost.overhead_seconds() == pytest.approx(0.005)
    # a noisy fit that makes a forward free stops at the floor rather than prefill every row alone
    free = PrefillCost(torch.device("cpu"))
    for tokens in (100, 400, 900, 1600):
        free.record(tokens, 0.0001 * tokens - 0.001)
    assert free.overhead_tokens() == 32.0
    assert free.overhead_seconds() == pytest.approx(32 * 0.0001)  # the floor, at the fitted cost of a token
    # prefills of one size say nothing about the overhead
    same = PrefillCost(torch.device("cpu"))
    for seconds in (0.01, 0.02, 0.015, 0.011):
        same.record(500, seconds)
    assert same.overhead_tokens() == DEFAULT_OVERHEAD_TOKENS


class _LogitsOfEveryPosition(torch.nn.Module):
    """A causal LM whose forward takes no `logits_to_keep` (some remote-code models): its prefill
    returns every position's logits, and the engine reads all but each prompt's last token."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, input_ids, attention_mask, position_ids, cache, use_cache=True):
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache, use_cache=True
        )

    def get_output_embeddings(self):
        return self.model.get_output_embeddings()


def _forward_costs(monkeypatch, tokens: float) -> None:
    """Every prefill forward's fixed cost taken as `tokens` tokens of padding."""
    monkeypatch.setattr(PrefillCost, "overhead_tokens", lambda self: tokens)


@pytest.fixture
def rows_apart(monkeypatch):
    """A forward costs less than a token of padding: rows of different lengths are prefilled apart."""
    _forward_costs(monkeypatch, 0.5)


def _ragged_prompts(head: int = 0) -> list[list[int]]:
    """Ragged prompts, with a `head`-token template first where asked (a held head is then reused)."""
    generator = torch.Generator().manual_seed(11)
    template = torch.randint(2, 64, (head,), generator=generator).tolist()
    lengths = [1, 3, 4, 9, 17, 30, 45, 2, 60, 5, 33, 4]
    return [template + torch.randint(2, 64, (n,), generator=generator).tolist() for n in lengths]


def _requests(prompts: list[list[int]]) -> list[GenerationRequest]:
    return [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=10, temperature=0.0)) for i, p in enumerate(prompts)
    ]


def _padded_tokens(lm: RaggedLM, monkeypatch) -> list[int]:
    """The tokens each of `lm`'s prefills will run, padding included."""
    tokens: list[int] = []
    prefill = lm.prefill

    def counted(cache, rows, input_ids, *args, **kwargs):
        tokens.append(input_ids.numel())
        return prefill(cache, rows, input_ids, *args, **kwargs)

    monkeypatch.setattr(lm, "prefill", counted)
    return tokens


@pytest.mark.parametrize("head", [0, 40])
@pytest.mark.parametrize("static_shapes", [False, True])
@pytest.mark.parametrize("contender", ["target_only", "draft", "ngram"])
def test_rows_prefilled_apart_decode_as_the_target_alone(
    target, draft, rows_apart, monkeypatch, head, static_shapes, contender
):
    prompts = _ragged_prompts(head)
    config = DecodingConfig(
        batch_size=5,
        num_speculative_tokens=3,
        fixed_k=True,
        static_shapes=static_shapes,
        model_free="ngram" if contender == "ngram" else None,
        strict=True,
    )
    engine = SpeculativeEngine(target, IdTokenizer(), draft if contender == "draft" else None, config)
    padded = _padded_tokens(engine.target_lm, monkeypatch)
    drafted = [] if engine._draft_proposer is None else _padded_tokens(engine._draft_proposer.lm, monkeypatch)
    results = {r.key: r.token_ids for r in engine.generate(_requests(prompts))}
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_greedy(target, prompt, 10), f"prompt {i}"
    # no padding: every row's prompt (after a held head) ran in a prefill of its length alone
    assert sum(padded) == engine.stats.prefill_tokens
    assert len(padded) > 3  # more prefills than the batch's admissions
    if contender == "draft":
        assert len(drafted) > 3


@pytest.mark.parametrize("head", [0, 40])
def test_the_draft_model_drafts_the_same_from_rows_prefilled_apart(target, draft, monkeypatch, head):
    # the output is the target's whatever the draft proposes; a wrong draft cache shows in what it proposes
    def drafts(forward_tokens: float):
        _forward_costs(monkeypatch, forward_tokens)
        config = DecodingConfig(batch_size=5, num_speculative_tokens=3, fixed_k=True, strict=True)
        engine = SpeculativeEngine(target, IdTokenizer(), draft, config)
        results = sorted(engine.generate(_requests(_ragged_prompts(head))), key=lambda r: r.key)
        return [(r.token_ids, r.draft_tokens, r.accepted_tokens) for r in results], engine.stats.draft_forwards

    apart, apart_forwards = drafts(0.5)
    together, together_forwards = drafts(10.0**9)
    assert apart == together
    assert apart_forwards > together_forwards


def test_a_model_without_chosen_logits_prefills_apart_too(target, rows_apart, monkeypatch):
    prompts = _ragged_prompts()
    engine = SpeculativeEngine(
        _LogitsOfEveryPosition(target), IdTokenizer(), None, DecodingConfig(batch_size=5, strict=True)
    )
    assert not engine.target_lm.keeps_logits
    padded = _padded_tokens(engine.target_lm, monkeypatch)
    results = {r.key: r.token_ids for r in engine.generate(_requests(prompts))}
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_greedy(target, prompt, 10), f"prompt {i}"
    assert sum(padded) == engine.stats.prefill_tokens  # all but each prompt's last token, no padding


def test_a_ragged_admission_pads_less_than_its_longest_prompt_times_its_rows(target, monkeypatch):
    # the measured default: short and long prompts admitted together are prefilled in two forwards
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 64, (n,), generator=generator).tolist() for n in [4] * 6 + [120] * 2]
    engine = SpeculativeEngine(target, IdTokenizer(), None, DecodingConfig(batch_size=8, strict=True))
    padded = _padded_tokens(engine.target_lm, monkeypatch)
    results = {r.key: r.token_ids for r in engine.generate(_requests(prompts))}
    assert all(results[i] == reference_greedy(target, p, 10) for i, p in enumerate(prompts))
    assert padded == [6 * 4, 2 * 120]


def _admissions(engine: SpeculativeEngine, monkeypatch) -> list[int]:
    """The rows each of `engine`'s admissions will take."""
    counts: list[int] = []
    admit = engine._admit

    def counted(batch, requests):
        counts.append(len(requests))
        return admit(batch, requests)

    monkeypatch.setattr(engine, "_admit", counted)
    return counts


@pytest.mark.parametrize("uses_draft", [False, True])
def test_rows_ending_on_different_steps_are_refilled_several_to_a_prefill(target, draft, monkeypatch, uses_draft):
    # one row ends a step: refilled at once, each would be a prefill of its own
    prompts = _ragged_prompts()
    requests = [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=2 + 3 * (i % 5), temperature=0.0))
        for i, p in enumerate(prompts)
    ]

    def admissions(forward_s: float) -> list[int]:
        monkeypatch.setattr(PrefillCost, "overhead_seconds", lambda self: forward_s)
        config = DecodingConfig(batch_size=5, num_speculative_tokens=2, fixed_k=True, strict=True)
        engine = SpeculativeEngine(target, IdTokenizer(), draft if uses_draft else None, config)
        counts = _admissions(engine, monkeypatch)
        results = {r.key: r.token_ids for r in engine.generate(requests)}
        for request in requests:
            expected = reference_greedy(target, list(request.prompt_token_ids), request.params.max_tokens)
            assert results[request.key] == expected, f"prompt {request.key}"
        assert sum(counts) == len(requests)
        return counts

    at_once = admissions(0.0)  # no fixed cost measured: a row is refilled as soon as it ends
    assert len(at_once) > 4 and min(at_once) == 1
    # a forward dearer than any wait: free rows wait until the batch is empty, then take five
    assert admissions(1e9) == [5, 5, 2]
