"""Model-free proposers (decoding/model_free.py): prompt lookup, the job's suffix index, the hybrid.

Unit checks of the lookup structures (matches, confidence, the index's bound), then the engine's
guarantees with each proposer: greedy tokens equal the target's own, seeded reproducible tokens equal
target-only decoding's, and sampled tokens follow the target's distribution (test_lossless.py's
chi-square test, in both sampling modes, on a prompt whose repeats make the proposers propose, with
the test's power shown on wrong samplers fed the same point masses).
"""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding import engine as decoding_engine
from specq.decoding import sampling as decoding_sampling
from specq.decoding.k_policy import Mix, SpeculationPolicy
from specq.decoding.model_free import HybridProposer, ModelFreeProposer, point_mass_probs
from specq.decoding.prompt_lookup import RowLookup
from specq.decoding.proposer import Offer
from specq.decoding.stats import DRAFT_MODEL, NGRAM, SUFFIX
from specq.decoding.suffix_index import SuffixIndex
from tests.policy_timing import modelled_step_times
from tests.test_lossless import _exact_joint, _keeps_rejected_drafts, _pvalue, _sampled_joint, lossless_pair
from tests.test_reproducible import _position_blind_noise
from tests.tiny_models import IdTokenizer, reference_greedy

# -- the lookup structures --------------------------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_longest_match():
    lookup = RowLookup(min_match=2, max_match=4)
    lookup.extend([7, 1, 2, 3, 9, 9, 5, 2, 3, 4, 8, 1, 2, 3])
    # the suffix 1 2 3 occurred at 1..3 (followed by 9 9 5); 2 3 alone would point at 8..10 (4 8 1)
    assert lookup.propose(3) == ([9, 9, 5], 3)
    assert lookup.propose(10)[0] == [9, 9, 5, 2, 3, 4, 8, 1, 2, 3]  # up to the end of the sequence
    # then it copies its own proposal, as if the sequence went on repeating its last 13 tokens
    assert lookup.propose(12)[0] == [9, 9, 5, 2, 3, 4, 8, 1, 2, 3, 9, 9]


def test_prompt_lookup_extends_a_repetition_past_the_end_of_the_sequence():
    lookup = RowLookup(min_match=3, max_match=6)
    lookup.extend([5, 6, 1, 2, 1, 2, 1, 2])  # the period 1 2 matches two tokens back
    assert lookup.propose(7) == ([1, 2, 1, 2, 1, 2, 1], 4)  # 1 2 1 2 last occurred at 2..5


def test_prompt_lookup_without_a_match_proposes_nothing():
    lookup = RowLookup(min_match=3, max_match=6)
    lookup.extend([1, 2, 3, 4, 5, 1, 2])  # 1 2 recurs, but a match needs 3 tokens
    assert lookup.propose(4) == ([], 0)


def test_a_suffix_proposal_displaces_a_rows_prompt_lookup_only_where_it_expects_more():
    index = SuffixIndex(min_context=2, max_context=4, min_confidence=0.1)
    index.add([1, 2, 3, 4, 5, 6, 7])  # after 1 2 3: 4 5 6 7
    policy = SpeculationPolicy(8, fixed=False)
    proposer = ModelFreeProposer(8, 16, index, policy=policy)
    proposer.resize(1, 0, None)
    lookup = RowLookup(3, 6)
    lookup.extend([1, 2, 3, 9, 1, 2, 3])  # prompt lookup: 9 1 2 3 ..., 8 tokens (the period repeated)
    proposer.lookups[0] = lookup
    batch = SimpleNamespace(rows=1)

    def offered() -> tuple[int, int]:
        offer = proposer.offer(batch, np.array([0]), np.array([8]))  # type: ignore[arg-type]
        return int(offer.lengths[0]), int(offer.sources[0])

    assert offered() == (8, NGRAM)  # the same prior acceptance: 8 tokens expect more than 4
    for _ in range(20):  # prompt lookup's first token rejected, the suffix index's four accepted
        policy.observe_acceptance(np.array([0, 4]), np.array([8, 4]), np.array([NGRAM, SUFFIX]))
    assert offered() == (4, SUFFIX)


def test_prompt_lookup_indexes_what_arrived_since_its_last_lookup():
    # tokens are indexed lazily, at the next lookup: fed in pieces, with lookups in between or not,
    # the proposals are those of the whole sequence fed at once
    rng = np.random.default_rng(0)
    sequence = rng.integers(0, 5, size=300).tolist()
    whole = RowLookup(min_match=3, max_match=6)
    whole.extend(sequence)
    pieces = RowLookup(min_match=3, max_match=6)
    for start in range(0, 300, 7):
        pieces.extend(sequence[start : start + 7])
        if start % 21 == 0:
            pieces.propose(4)
    assert pieces.propose(8) == whole.propose(8)
    assert pieces.continuation_at == whole.continuation_at


def _most_frequent_path(sequences: list[list[int]], suffix: list[int], limit: int, index: SuffixIndex) -> list[int]:
    """The suffix index's proposal worked out from the raw sequences: at every token, the longest
    context the sequences hold, its most frequent follower (ties: the first seen), while confident."""
    path, proposed, confidence = list(suffix), list[int](), 1.0
    while len(proposed) < limit:
        for n in range(min(index.max_context, len(path)), index.min_context - 1, -1):
            context = tuple(path[-n:])
            counts: dict[int, int] = {}
            for sequence in sequences:
                for end in range(n, len(sequence)):
                    if tuple(sequence[end - n : end]) == context:
                        counts[sequence[end]] = counts.get(sequence[end], 0) + 1
            if counts:
                break
        else:
            return proposed
        token = max(counts, key=lambda t: counts[t])
        if confidence * counts[token] / sum(counts.values()) < index.min_confidence:
            return proposed
        confidence *= counts[token] / sum(counts.values())
        proposed.append(token)
        path.append(token)
    return proposed


def test_the_suffix_index_walks_the_longest_known_contexts():
    # the walk searches each next context from one token longer than the last: the same proposals as
    # searching every length
    rng = np.random.default_rng(1)
    sequences = [rng.integers(0, 4, size=60).tolist() for _ in range(8)]
    index = SuffixIndex(min_context=2, max_context=6, min_confidence=0.2)
    for sequence in sequences:
        index.add(sequence)
    for _ in range(40):
        suffix = rng.integers(0, 4, size=7).tolist()
        assert index.propose(suffix, limit=8).tokens == _most_frequent_path(sequences, suffix, 8, index)


def test_the_suffix_index_proposes_the_most_frequent_continuation_while_confident():
    index = SuffixIndex(min_context=2, max_context=4, min_confidence=0.4)
    for _ in range(3):
        index.add([1, 2, 3, 4, 5, 6])
    index.add([1, 2, 3, 4, 7, 8])
    proposal = index.propose([9, 1, 2], limit=8)
    # 3 4 always follow 1 2; then 5 (3 of 4) and 6; the path's confidence 0.75 stays above 0.4
    assert proposal.tokens == [3, 4, 5, 6]
    assert proposal.confidence == pytest.approx(0.75)
    assert index.propose([42, 43], limit=8).tokens == []  # an unknown context
    index.min_confidence = 0.8
    assert index.propose([1, 2], limit=8).tokens == [3, 4]  # 5 follows 3 4 in 3 of 4: not confident enough


def test_the_suffix_index_evicts_beyond_its_bound_and_keeps_proposing():
    index = SuffixIndex(max_contexts=50, min_context=2, max_context=3)
    for start in range(0, 1000, 10):
        index.add(list(range(start, start + 20)))
    assert len(index) == 50 and index.evictions > 0
    index.add([500, 501, 502, 503])
    assert index.propose([500, 501], limit=2).tokens == [502, 503]  # the newest contexts stay


def test_the_suffix_index_counts_what_it_is_fed_only_when_asked_and_keeps_the_latest():
    index = SuffixIndex(min_context=2, max_context=2, max_pending=2)
    for first in (1, 2, 3):
        index.add([first, 8, 9])
    assert index._followers == {}  # queued, not counted: a resting engine pays nothing
    assert index.propose([2, 8], limit=1).tokens == [9]
    assert index.propose([1, 8], limit=1).tokens == []  # the oldest queued sequence was dropped
    assert len(index) == 2


# -- the engine: greedy, reproducible, distribution --------------------------------------------------


def _repetitive_prompts() -> list[list[int]]:
    """Prompts that repeat spans of themselves and of each other, as a templated job's do."""
    template = [5, 9, 13, 2, 40, 41, 42, 43, 44]
    return [[*template, 10 + i, 11 + i, *template[:6]] for i in range(6)] + [[3, 4], [7, 8, 9, 7, 8]]


MODES = [("ngram", False), ("suffix", False), ("ngram", True), ("suffix", True)]


def _engine(target, draft, model_free, with_draft, **config):
    config = {"strict": True, "num_speculative_tokens": 4, "model_free": model_free, **config}
    return SpeculativeEngine(target, IdTokenizer(), draft if with_draft else None, DecodingConfig(**config))


@pytest.mark.parametrize(
    ("model_free", "with_draft", "batch_size", "fixed_k"),
    [*[(m, d, 4, False) for m, d in MODES], ("ngram", False, 1, True), ("suffix", True, 1, True)],
)
def test_greedy_tokens_are_the_targets_own(target, draft, model_free, with_draft, batch_size, fixed_k, monkeypatch):
    # with models this small a lookup's time is a large share of a step, so the hybrid may look up only
    # now and then (tested below); here it looks up every step, so that its choices are exercised
    monkeypatch.setattr(SpeculationPolicy, "lookups_pay", lambda self, rows: True)
    prompts = _repetitive_prompts()
    requests = [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=24, temperature=0.0)) for i, p in enumerate(prompts)
    ]
    engine = _engine(target, draft, model_free, with_draft, batch_size=batch_size, fixed_k=fixed_k)
    # k and each row's proposer follow step times: the test's, not a busy machine's (a verify costs a fixed
    # 10 ms whatever its width, a draft forward 1 ms, so speculating always pays)
    modelled_step_times(monkeypatch, engine.policy, lambda rows, width: 0.010, t_draft_forward=0.001)
    results = {r.key: r.token_ids for r in engine.generate(requests)}
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_greedy(target, prompt, 24), f"prompt {i}"
    by_proposer = engine.stats.by_proposer
    looked_up = by_proposer["ngram"]["draft_tokens"] + by_proposer["suffix"]["draft_tokens"]
    assert looked_up > 0  # the proposers did propose
    if with_draft:
        assert by_proposer["draft"]["draft_tokens"] > 0  # and the hybrid used both, row by row
    assert sum(c["accepted_tokens"] for c in by_proposer.values()) == engine.stats.num_accepted_tokens


def test_the_suffix_index_carries_one_requests_output_to_the_next(target):
    prompt = (5, 9, 13, 2, 40)
    requests = [GenerationRequest(i, prompt, SamplingParams(max_tokens=24, temperature=0.0)) for i in range(2)]
    engine = _engine(target, None, "suffix", False, batch_size=1, fixed_k=True)
    results = list(engine.generate(requests))
    assert results[0].token_ids == results[1].token_ids == reference_greedy(target, list(prompt), 24)
    # the second request, one by one after the first, replays the first one's output from the index
    assert results[1].accepted_tokens >= 15 > results[0].accepted_tokens
    assert engine.stats.by_proposer["suffix"]["accepted_tokens"] >= 10  # prompt lookup takes ties


def test_the_suffix_index_is_fed_outputs_after_their_prompts_last_tokens_not_whole_prompts(target):
    prompt = tuple(range(20, 44))  # 24 distinct tokens
    index = SuffixIndex()
    engine = SpeculativeEngine(target, IdTokenizer(), None, DecodingConfig(model_free="suffix"), suffix_index=index)
    [result] = engine.generate([GenerationRequest(0, prompt, SamplingParams(max_tokens=6, temperature=0.0))])
    sequence = [*prompt[-8:], *result.token_ids]  # what the index is fed: the output after 8 prompt tokens
    assert index.propose(prompt[-10:-8], limit=1).tokens == []  # the prompt's earlier contexts are not indexed
    assert index.propose(sequence[:2], limit=1).tokens == [sequence[2]]


def test_a_tiny_suffix_index_evicts_and_fails_no_request(target):
    index = SuffixIndex(max_contexts=8)
    prompts = _repetitive_prompts()
    requests = [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=16, temperature=0.0)) for i, p in enumerate(prompts)
    ]
    engine = SpeculativeEngine(
        target, IdTokenizer(), None, DecodingConfig(model_free="suffix", strict=True, batch_size=3), suffix_index=index
    )
    results = {r.key: r for r in engine.generate(requests)}
    assert all(
        r.error is None and r.token_ids == reference_greedy(target, prompts[r.key], 16) for r in results.values()
    )
    assert len(index) == 8 and index.evictions > 0


def test_a_resting_policy_makes_the_engine_skip_the_offers(target, monkeypatch):
    # verification costs its width at every row count and the offers a fifth of a plain step: after the
    # first choice the policy rests, and the engine asks the proposer for offers only at the policy's
    # probes; the tokens do not change
    policy = SpeculationPolicy(4, fixed=False, probe_interval=16)
    modelled_step_times(monkeypatch, policy, lambda rows, width: 0.010 * width, t_offer=0.002)
    for rows in range(1, 9):
        for width in range(1, 6):
            for _ in range(3):
                policy.observe_step(rows, width - 1, 0.0, 0.010 * width, 0.010 * width)
    for _ in range(50):
        policy.observe_acceptance(np.full(8, 1), np.full(8, 4), np.full(8, NGRAM))
    engine = SpeculativeEngine(
        target, IdTokenizer(), None, DecodingConfig(num_speculative_tokens=4, model_free="ngram"), policy=policy
    )
    proposer = engine.proposer
    assert proposer is not None
    offer, offers = proposer.offer, 0

    def counted(*args):
        nonlocal offers
        offers += 1
        return offer(*args)

    monkeypatch.setattr(proposer, "offer", counted)
    prompts = _repetitive_prompts()
    requests = [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=24, temperature=0.0)) for i, p in enumerate(prompts)
    ]
    results = {r.key: r.token_ids for r in engine.generate(requests)}
    assert all(results[i] == reference_greedy(target, p, 24) for i, p in enumerate(prompts))
    assert engine.stats.num_steps > 20 and offers < engine.stats.num_steps / 4


@pytest.mark.parametrize(("model_free", "with_draft"), MODES)
def test_seeded_reproducible_tokens_are_target_only_tokens(target, draft, model_free, with_draft):
    prompts = _repetitive_prompts()
    # cool enough that the tiny model's samples repeat themselves, so prompt lookup finds matches
    params = SamplingParams(max_tokens=40, temperature=0.3, top_p=0.95)
    requests = [GenerationRequest(i, tuple(p), replace(params, seed=100 + i)) for i, p in enumerate(prompts)]
    alone = SpeculativeEngine(target, IdTokenizer(), None, DecodingConfig(sampling="reproducible", batch_size=1))
    expected = {r.key: r.token_ids for r in alone.generate(requests)}
    engine = _engine(target, draft, model_free, with_draft, batch_size=4, sampling="reproducible")
    assert {r.key: r.token_ids for r in engine.generate(requests)} == expected
    assert engine.stats.num_draft_tokens > 0


# The repeat makes prompt lookup propose: where the first token (sampled at the prefill) is 4 (the
# target's probability of it: 0.45), the suffix 5 0 4 occurred before, followed by 7 5, and the first
# speculative step verifies those; acceptances and rejections both happen often.
REPEATING = (7, 5, 0, 4, 7, 5, 0)


@pytest.fixture(scope="module")
def lossless_models():
    return lossless_pair()


# The hybrid's reproducible mode is covered token for token above (target-only's tokens), a stronger check.
@pytest.mark.parametrize(
    ("sampling", "model_free", "with_draft"),
    [("exact", "ngram", False), ("reproducible", "ngram", False), ("exact", "suffix", True)],
)
def test_sampled_tokens_follow_the_target(lossless_models, sampling, model_free, with_draft):
    target, draft = lossless_models
    sampled = _sampled_joint(
        target, draft if with_draft else None, 1.0, sampling=sampling, model_free=model_free, prompt=REPEATING
    )
    assert _pvalue(sampled, _exact_joint(target, 1.0, prompt=REPEATING)) > 1e-3


def test_sampled_tokens_follow_the_target_where_draft_rows_stop_short_of_looked_up_ones(lossless_models, monkeypatch):
    # A plan forced on every step: rows with a lookup verify it 2 deep, the others the draft model's one
    # token, so a step's draft_probs are one-hot rows beside draft-model rows padded past their depth. The
    # policy would rarely choose it here (these lookups are mostly rejected); exactness may not depend on it.
    target, draft = lossless_models
    monkeypatch.setattr(SpeculationPolicy, "lookups_pay", lambda self, rows: True)
    monkeypatch.setattr(SpeculationPolicy, "could_take_a_lookup", lambda self, *args: True)
    monkeypatch.setattr(
        SpeculationPolicy, "best_mix", lambda self, rows, drafted, looked_up, sources: Mix(2, 1, looked_up > 1, 0, 0, 0)
    )
    mixed_steps = []
    propose = HybridProposer.propose

    def recorded(self, batch, k, num_draft_h, stats):
        mixed_steps.append({1, 2} <= set(num_draft_h.tolist()))
        return propose(self, batch, k, num_draft_h, stats)

    monkeypatch.setattr(HybridProposer, "propose", recorded)
    sampled = _sampled_joint(target, draft, 1.0, sampling="exact", model_free="suffix", prompt=REPEATING, max_tokens=4)
    assert any(mixed_steps)
    assert _pvalue(sampled, _exact_joint(target, 1.0, prompt=REPEATING)) > 1e-3


def test_the_same_test_rejects_a_wrong_sampler_of_point_masses(lossless_models, monkeypatch):
    target, _ = lossless_models
    monkeypatch.setattr(decoding_engine, "rejection_sample", _keeps_rejected_drafts)
    sampled = _sampled_joint(target, None, 1.0, sampling="exact", model_free="ngram", prompt=REPEATING)
    assert _pvalue(sampled, _exact_joint(target, 1.0, prompt=REPEATING)) < 1e-6


def test_the_same_test_rejects_a_wrong_race_with_point_masses(lossless_models, monkeypatch):
    target, _ = lossless_models
    monkeypatch.setattr(decoding_sampling, "race_exponentials", _position_blind_noise)
    sampled = _sampled_joint(target, None, 1.0, sampling="reproducible", model_free="ngram", prompt=REPEATING)
    assert _pvalue(sampled, _exact_joint(target, 1.0, prompt=REPEATING)) < 1e-6


def _policy_with(t_draft: float, draft_acceptance: float, looked_up_acceptance: float) -> SpeculationPolicy:
    return _policy_of(t_draft, {DRAFT_MODEL: draft_acceptance, NGRAM: looked_up_acceptance})


def _policy_of(t_draft: float, acceptance: dict[int, float]) -> SpeculationPolicy:
    """A policy that measured one-row steps of a 10 ms target and `t_draft` per draft forward, and each
    proposer accepting `acceptance[source]` of 4 tokens a step on average."""
    policy = SpeculationPolicy(4, fixed=False, probe_interval=1000)
    for width in range(1, 6):
        for _ in range(3):
            k = width - 1
            policy.observe_step(1, k, k * t_draft, 0.010, 0.010 + k * t_draft)
    for step in range(100):
        for source, rate in acceptance.items():
            accepted = int(4 * rate * (step + 1)) - int(4 * rate * step)  # on average 4 * rate
            policy.observe_acceptance(np.array([accepted]), np.array([4]), np.array([source]))
    return policy


@pytest.mark.parametrize(
    ("t_draft", "looked_up_acceptance", "alone"),
    [(0.010, 0.75, True), (0.0005, 0.25, False), (0.0005, 1.0, True)],
)
def test_the_hybrid_drops_the_draft_model_where_looked_up_proposals_alone_pay_more(
    t_draft, looked_up_acceptance, alone
):
    # one row: the draft model offers 4 tokens at 75% acceptance, prompt lookup 4 of its own
    policy = _policy_with(t_draft, 0.75, looked_up_acceptance)
    mix = policy.best_mix(1, np.array([4]), np.array([4]), np.array([NGRAM]))
    assert mix.k > 0
    assert (mix.depth == 0) is alone
    assert bool(mix.takes_lookup[0]) is alone


def _compute_bound_policy(
    rows: int, acceptance: dict[int, float], t_draft: float = 0.001, t_token: float = 0.004
) -> SpeculationPolicy:
    """A policy that measured steps of `rows` rows whose target costs 10 ms plus `t_token` a verified
    token past the first (by default compute-bound, as this CPU at 16 rows), `t_draft` a draft forward,
    and each proposer's draft tokens accepted with probability `acceptance[source]` each, given the one
    before."""
    policy = SpeculationPolicy(8, fixed=False, probe_interval=1000)
    for k in range(9):
        for _ in range(3):
            t_target = 0.010 + t_token * k
            policy.observe_step(rows, k, k * t_draft, t_target, t_target + k * t_draft)
    quantiles = (np.arange(1000) + 0.5) / 1000
    for source, rate in acceptance.items():
        # a geometric number of accepted tokens: P(at least j) = rate ** j
        accepted = np.minimum(np.floor(np.log(quantiles) / np.log(max(rate, 1e-9))), 8).astype(np.int64)
        policy.observe_acceptance(accepted, np.full(1000, 8), np.full(1000, source))
    return policy


def test_a_long_lookup_is_weighed_at_the_width_the_batch_verifies():
    # 16 rows, the draft model accepting 80%; one row's 8-token lookup at 70% expects more than the
    # draft model's proposal at the draft model's own k (the old per-row rule took it), but the batch
    # verifies only a few tokens a row, and there the draft model's proposal expects more
    rows = 16
    policy = _compute_bound_policy(rows, {DRAFT_MODEL: 0.8, NGRAM: 0.7})
    full = np.full(rows, 8)
    lookups = np.zeros(rows, np.int64)
    lookups[3] = 8
    mix = policy.best_mix(rows, full, lookups, np.full(rows, NGRAM))
    by_draft, by_lookup = policy.expected_tokens_by_length(DRAFT_MODEL), policy.expected_tokens_by_length(NGRAM)
    assert 0 < mix.k < 8 and mix.depth == mix.k
    assert by_lookup[8] > by_draft[mix.k]  # what the old rule compared
    assert not mix.takes_lookup.any()


def test_the_mix_is_never_estimated_below_either_proposer_alone_and_the_step_keeps_its_k():
    rng = np.random.default_rng(1)
    for _ in range(300):
        rows = int(rng.integers(1, 17))
        acceptance = {source: float(rng.uniform()) for source in (DRAFT_MODEL, NGRAM, SUFFIX)}
        policy = _compute_bound_policy(16, acceptance, t_draft=float(rng.choice([0.0005, 0.002, 0.008])))
        full = rng.integers(0, 9, rows)
        lookups, lookup_sources = rng.integers(0, full + 1), rng.choice([NGRAM, SUFFIX], rows)
        mix = policy.best_mix(16, full, lookups, lookup_sources)
        _, draft_alone = policy.best(16, 8, full, np.full(rows, DRAFT_MODEL))
        _, lookups_alone = policy.best(16, 8, lookups, lookup_sources)
        assert mix.rate >= max(draft_alone, lookups_alone) * (1 - 1e-9)
        assert mix.draft_alone_rate == pytest.approx(draft_alone)  # what the lookup gate weighs the mix by
        if mix.k == 0:
            continue
        # the offers the hybrid makes from the mix: the step's own choice of k lands on the mix's k
        offers = np.where(mix.takes_lookup, np.minimum(lookups, mix.k), np.minimum(full, mix.depth))
        sources = np.where(mix.takes_lookup, lookup_sources, DRAFT_MODEL)
        k, rate = policy.best(16, 8, offers, sources)
        assert rate == pytest.approx(mix.rate)
        assert min(k, int(offers.max())) == int(offers.max())


class _Offers:
    """A proposer stub that offers given lengths and sources to the rows it is asked about."""

    def __init__(self, offer: Offer, sources: tuple[int, ...] = ()) -> None:
        self.max_k = 4
        self.sources = sources
        self._offer = offer
        self.asked: list[np.ndarray] = []

    def offer(self, batch, live, limits) -> Offer:
        self.asked.append(live)
        lengths = np.zeros_like(self._offer.lengths)
        lengths[live] = self._offer.lengths[live]
        return Offer(lengths, self._offer.sources.copy())


def _hybrid(draft: _Offers, looked_up: _Offers, policy: SpeculationPolicy) -> HybridProposer:
    return HybridProposer(draft, looked_up, policy)  # type: ignore[arg-type]


def test_the_hybrid_looks_nothing_up_where_no_lookup_could_be_taken():
    # the draft model accepts 90% and costs little; prompt lookup 30%: even a full-length lookup loses
    # to the draft model's proposal, and lookups alone, without the draft's forwards, yield less
    rows = 3
    drafted = _Offers(Offer(np.full(rows, 4), np.full(rows, DRAFT_MODEL)))
    looked_up = _Offers(Offer(np.full(rows, 4), np.full(rows, NGRAM)), sources=(NGRAM,))
    batch = SimpleNamespace(rows=rows)
    live, limits = np.arange(rows), np.full(rows, 4)
    losing = _hybrid(drafted, looked_up, _policy_of(0.0005, {DRAFT_MODEL: 0.9, NGRAM: 0.3, SUFFIX: 0.3}))
    assert (losing.offer(batch, live, limits).sources == DRAFT_MODEL).all()  # type: ignore[arg-type]
    assert looked_up.asked == []
    winning = _hybrid(drafted, looked_up, _policy_of(0.0005, {DRAFT_MODEL: 0.5, NGRAM: 1.0, SUFFIX: 0.3}))
    assert (winning.offer(batch, live, limits).sources == NGRAM).all()  # type: ignore[arg-type]
    assert looked_up.asked[-1].tolist() == live.tolist()
    # before any step is timed, lookups alone are never chosen, but a row still takes its lookup where it
    # expects a little more from it than from the draft model's proposal
    untimed = SpeculationPolicy(4, fixed=False)
    for _ in range(100):
        untimed.observe_acceptance(np.array([3, 3]), np.array([4, 4]), np.array([DRAFT_MODEL, NGRAM]))
        untimed.observe_acceptance(np.array([4]), np.array([4]), np.array([NGRAM]))
    warming = _hybrid(drafted, looked_up, untimed)
    assert (warming.offer(batch, live, limits).sources == NGRAM).all()  # type: ignore[arg-type]
    assert looked_up.asked[-1].tolist() == live.tolist()


def test_the_hybrid_checks_whether_a_lookup_could_be_taken_only_after_a_step_that_took_none():
    # where rows take their lookups step after step, the check costs as much as the lookups themselves
    rows = 3
    drafted = _Offers(Offer(np.full(rows, 4), np.full(rows, DRAFT_MODEL)))
    batch, live, limits = SimpleNamespace(rows=rows), np.arange(rows), np.full(rows, 4)
    policy = _policy_of(0.0005, {DRAFT_MODEL: 0.5, NGRAM: 1.0, SUFFIX: 0.3})
    checks = []
    check = policy.could_take_a_lookup

    def counted(*args):
        checks.append(args)
        return check(*args)

    policy.could_take_a_lookup = counted  # type: ignore[method-assign]
    matching = _hybrid(drafted, _Offers(Offer(np.full(rows, 4), np.full(rows, NGRAM)), (NGRAM,)), policy)
    for _ in range(5):
        assert (matching.offer(batch, live, limits).sources == NGRAM).all()  # type: ignore[arg-type]
    assert len(checks) == 1  # the first step's
    missing = _hybrid(drafted, _Offers(Offer(np.zeros(rows, np.int64), np.full(rows, NGRAM)), (NGRAM,)), policy)
    for _ in range(5):
        assert (missing.offer(batch, live, limits).sources == DRAFT_MODEL).all()  # type: ignore[arg-type]
    assert len(checks) == 1 + 5  # no lookup taken: every step checks first


def test_whether_a_lookup_could_be_taken_is_judged_at_the_length_a_lookup_may_reach():
    # the draft model goes 4 deep (its default depth in a hybrid of K = 8) at 80%, cheaply; a lookup at
    # 75% loses to it at 4 tokens but wins at 8 on a verify whose width costs nothing (a GPU's)
    policy = _compute_bound_policy(1, {DRAFT_MODEL: 0.8, NGRAM: 0.75}, t_draft=0.0001, t_token=0.0)
    four, eight = np.array([4]), np.array([8])
    assert policy.could_take_a_lookup(1, four, eight, (NGRAM,))
    assert not policy.could_take_a_lookup(1, four, four, (NGRAM,))
    drafted = _Offers(Offer(four, np.array([DRAFT_MODEL])))
    looked_up = _Offers(Offer(eight, np.array([NGRAM])), (NGRAM,))
    looked_up.max_k = 8
    offer = _hybrid(drafted, looked_up, policy).offer(SimpleNamespace(rows=1), np.arange(1), eight)  # type: ignore[arg-type]
    assert looked_up.asked and offer.sources.tolist() == [NGRAM] and offer.lengths.tolist() == [8]


def test_a_hybrid_of_the_default_k_drafts_4_deep_and_verifies_lookups_8_deep(target, draft, monkeypatch):
    monkeypatch.setattr(SpeculationPolicy, "lookups_pay", lambda self, rows: True)
    prompts = _repetitive_prompts()
    requests = [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=24, temperature=0.0)) for i, p in enumerate(prompts)
    ]
    engine = SpeculativeEngine(
        target, IdTokenizer(), draft, DecodingConfig(model_free="suffix", batch_size=4, fixed_k=True, strict=True)
    )
    depths = []
    propose = engine.proposer.draft.propose  # type: ignore[union-attr]

    def recorded(batch, k, num_draft_h, stats):
        depths.append(k)
        return propose(batch, k, num_draft_h, stats)

    engine.proposer.draft.propose = recorded  # type: ignore[union-attr]
    results = {r.key: r.token_ids for r in engine.generate(requests)}
    for i, prompt in enumerate(prompts):
        assert results[i] == reference_greedy(target, prompt, 24), f"prompt {i}"
    assert depths and max(depths) == 4
    assert engine.stats.accepted_per_position[4] > 0  # looked-up rows verified past the draft model's depth


def test_the_hybrid_skips_lookups_only_where_neither_plan_would_have_taken_one():
    # Random policies and offers: wherever the hybrid, shown every row's lookup, takes one (row by row or
    # lookups alone), it must also have chosen to look up before seeing them.
    rng = np.random.default_rng(0)
    skipped = 0
    for _ in range(500):
        rows = int(rng.integers(1, 6))
        acceptance = {source: float(rng.uniform()) for source in (DRAFT_MODEL, NGRAM, SUFFIX)}
        policy = _policy_of(float(rng.choice([0.0005, 0.003, 0.010])), acceptance)
        draft_lengths = rng.integers(0, 5, rows)
        lookup_lengths = rng.integers(0, draft_lengths + 1)
        lookups = Offer(lookup_lengths, rng.choice([NGRAM, SUFFIX], rows))
        batch, live = SimpleNamespace(rows=rows), np.arange(rows)
        drafted = Offer(draft_lengths, np.full(rows, DRAFT_MODEL))
        asked = _Offers(lookups, (NGRAM, SUFFIX))
        _hybrid(_Offers(drafted), asked, policy).offer(batch, live, draft_lengths)  # type: ignore[arg-type]
        policy.could_take_a_lookup = lambda *args: True  # type: ignore[method-assign]
        chosen = _hybrid(_Offers(drafted), _Offers(lookups, (NGRAM, SUFFIX)), policy).offer(
            batch,  # type: ignore[arg-type]
            live,
            draft_lengths,
        )
        takes_a_lookup = bool(((chosen.sources != DRAFT_MODEL) & (chosen.lengths > 0)).any())
        could = bool(asked.asked)
        assert could or not takes_a_lookup
        skipped += not could
    assert 25 < skipped < 475  # both outcomes were exercised


class _SlowOffers(_Offers):
    """Offers that take 2 ms to look up, as 16 rows' prompt lookups and suffix-index walks about do."""

    def offer(self, batch, live, limits) -> Offer:
        time.sleep(0.002)
        return super().offer(batch, live, limits)


@pytest.mark.parametrize("matching_rows", [1, 16])
def test_the_hybrid_looks_up_only_now_and_then_where_lookups_do_not_pay_for_their_time(matching_rows):
    # prompt lookup accepts 95%, so a lookup could always be taken; with one row of 16 matching, two
    # tokens, the plan gains less than the lookups' 2 ms cost: they are re-checked every few steps only
    rows = 16
    policy = _compute_bound_policy(rows, {DRAFT_MODEL: 0.8, NGRAM: 0.95})
    lookups = np.zeros(rows, np.int64)
    lookups[:matching_rows] = 2 if matching_rows == 1 else 8
    looked_up = _SlowOffers(Offer(lookups, np.full(rows, NGRAM)), (NGRAM,))
    hybrid = _hybrid(_Offers(Offer(np.full(rows, 8), np.full(rows, DRAFT_MODEL))), looked_up, policy)
    for _ in range(40):
        hybrid.offer(SimpleNamespace(rows=rows), np.arange(rows), np.full(rows, 8))  # type: ignore[arg-type]
    looked_up_steps = len(looked_up.asked)
    if matching_rows == 1:
        assert not policy.lookups_pay(rows)
        assert looked_up_steps == 8 + 32 // 8  # the first 8 steps, measuring, then every 8th
    else:
        assert policy.lookups_pay(rows)
        assert looked_up_steps == 40


def test_the_hybrids_draft_rows_go_no_deeper_than_the_step_pays_for():
    # a draft model at 50% acceptance pays for few tokens; a looked-up row at 100% may still take all 4
    policy = _policy_of(0.001, {DRAFT_MODEL: 0.5, NGRAM: 1.0, SUFFIX: 0.3})
    rows = 5
    looked_up = Offer(np.array([0, 4, 0, 0, 0]), np.full(rows, NGRAM))  # only row 1 has a match
    drafted = _Offers(Offer(np.full(rows, 4), np.full(rows, DRAFT_MODEL)))
    hybrid = _hybrid(drafted, _Offers(looked_up, (NGRAM,)), policy)
    offer = hybrid.offer(SimpleNamespace(rows=rows), np.arange(rows), np.full(rows, 4))  # type: ignore[arg-type]
    mix = policy.best_mix(rows, np.full(rows, 4), looked_up.lengths, looked_up.sources)
    assert 0 < mix.depth < mix.k == 4
    assert offer.sources.tolist() == [DRAFT_MODEL, NGRAM, DRAFT_MODEL, DRAFT_MODEL, DRAFT_MODEL]
    assert offer.lengths.tolist() == [mix.depth, 4, mix.depth, mix.depth, mix.depth]


def test_the_hybrids_draft_model_runs_only_as_deep_as_its_own_rows_go():
    class Drafts:
        def __init__(self) -> None:
            self.depths: list[int] = []

        def propose(self, batch, k, num_draft_h, stats):
            self.depths.append(k)
            return torch.full((batch.rows, k), 7), torch.full((batch.rows, k, 50), 1 / 50)

        def forget_drafts(self, *args) -> None:
            pass

    class Lookups:
        def propose(self, batch, k, num_draft_h, stats):
            return torch.full((batch.rows, k), 9), point_mass_probs(torch.full((batch.rows, k), 9), 50)

    drafts = Drafts()
    hybrid = HybridProposer.__new__(HybridProposer)
    hybrid.draft, hybrid.model_free = drafts, Lookups()  # type: ignore[assignment]
    hybrid._sources = np.array([DRAFT_MODEL, NGRAM, DRAFT_MODEL])
    sampled = SimpleNamespace(all_greedy=False, reproducible=False)
    batch = SimpleNamespace(rows=3, device=torch.device("cpu"), sampling=sampled, seq_lens=None, seq_h=None)
    ids, probs = hybrid.propose(batch, 4, np.array([2, 4, 1]), None)  # type: ignore[arg-type]
    assert drafts.depths == [2]  # not 4 forwards
    assert ids.tolist() == [[7, 7, 0, 0], [9, 9, 9, 9], [7, 7, 0, 0]]  # past a row's count: ignored padding
    assert probs is not None and probs.shape == (3, 4, 50)
    assert probs[1].argmax(-1).tolist() == [9] * 4 and float(probs[0, 2:].sum()) == 0.0
