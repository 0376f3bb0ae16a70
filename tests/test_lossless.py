"""Losslessness end to end: the engine's sampled tokens follow the target's exact distribution.

A tiny vocabulary makes the exact joint distribution of the first three tokens computable from the
target alone (the first is sampled at the prefill, the next two in the first speculative step);
thousands of seeds give a chi-square test with real power, shown by the same test rejecting two
deliberately wrong samplers.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding import engine as decoding_engine
from specq.decoding.config import ModelFree, SamplingMode
from specq.decoding.rejection import rejection_sample
from specq.decoding.sampling import sample_from_probs
from tests.test_sampling import truncated_reference
from tests.tiny_models import IdTokenizer, RepeatLastToken, tiny_llama, with_proposer

VOCAB, SAMPLES, PROMPT = 8, 12_000, (2, 5, 3)


def lossless_pair(target_vocab: int = VOCAB, draft_vocab: int = VOCAB):
    """(target, draft) on a tiny vocabulary, clearly different, with EOS off: the tiny vocabulary must not
    end sequences early."""
    target = tiny_llama(vocab=target_vocab, hidden=32, seed=0, sharpness=10.0)
    draft = tiny_llama(vocab=draft_vocab, hidden=32, layers=1, seed=5, sharpness=6.0)
    for model in (target, draft):
        model.generation_config.eos_token_id = None
        model.config.eos_token_id = None
    return target, draft


@pytest.fixture(scope="module")
def models():
    return lossless_pair()


def _exact_joint(
    target, temperature: float, top_k: int = 0, top_p: float = 1.0, prompt: tuple[int, ...] = PROMPT
) -> torch.Tensor:
    """P(t1, t2, t3 | prompt) under the target at these settings: [V, V, V]. The top-k / top-p cut is
    the reference of tests/test_sampling.py, not specq's own."""

    def probs(logits: torch.Tensor) -> torch.Tensor:  # [V]
        return truncated_reference(logits / temperature, top_p, top_k)

    vocab = range(target.config.vocab_size)
    with torch.no_grad():
        first = probs(target(torch.tensor([prompt])).logits[0, -1])  # [V]
        follow = torch.tensor([[*prompt, a] for a in vocab])
        second = torch.stack([probs(row) for row in target(follow).logits[:, -1]])  # [V, V]
        follow = torch.tensor([[*prompt, a, b] for a in vocab for b in vocab])
        third = torch.stack([probs(row) for row in target(follow).logits[:, -1]])  # [V * V, V]
    return first[:, None, None] * second[:, :, None] * third.view(len(vocab), len(vocab), -1)


def _sampled_joint(
    target,
    draft,
    temperature: float,
    point_mass: bool = False,
    sampling: SamplingMode = "exact",
    top_k: int = 0,
    top_p: float = 1.0,
    model_free: ModelFree | None = None,
    prompt: tuple[int, ...] = PROMPT,
    static_shapes: bool = False,
    max_tokens: int = 3,
) -> torch.Tensor:
    """Counts of the first three tokens of SAMPLES sampled completions of `max_tokens` tokens (more than 3:
    the first speculative step, after the prefill's token, may verify more than one draft token).
    `model_free`: that proposer (decoding/model_free.py), alone or beside `draft`; `static_shapes`: the
    padded path CUDA graphs decode on (decoding/static_shapes.py)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    requests = [GenerationRequest(i, prompt, replace(params, seed=i)) for i in range(SAMPLES)]
    # EOS off: the tiny vocabulary must not end sequences early
    engine = SpeculativeEngine(
        target,
        _NoEos(),
        draft,
        DecodingConfig(
            num_speculative_tokens=2,
            fixed_k=True,
            batch_size=2048,
            sampling=sampling,
            model_free=model_free,
            static_shapes=static_shapes,
        ),
    )
    vocab = target.config.vocab_size
    if point_mass:  # a model-free proposer in the draft's place
        engine = with_proposer(engine, RepeatLastToken(2, vocab))
    counts = torch.zeros(vocab, vocab, vocab)
    for result in engine.generate(requests):
        counts[tuple(result.token_ids[:3])] += 1
    if draft is not None or point_mass or model_free:  # the proposals were both accepted and rejected
        assert engine.stats.num_draft_tokens > 0 and 0 < engine.stats.acceptance_rate < 0.95
    return counts


class _NoEos(IdTokenizer):
    eos_token_id = None


def _pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    counts, probs = counts.flatten().double(), probs.flatten().double()
    keep = probs * counts.sum() >= 5  # chi-square needs expected counts >= 5; pool the rest
    observed, expected = counts[keep], probs[keep]
    if probs[~keep].sum() > 0:
        observed = torch.cat([observed, counts[~keep].sum().view(1)])
        expected = torch.cat([expected, probs[~keep].sum().view(1)])
    expected = expected / expected.sum() * observed.sum()
    return chisquare(observed.numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 3, 1.0), (0.8, 0, 0.7), (1.2, 5, 0.9)]
)
def test_first_three_tokens_follow_the_target(models, temperature, top_k, top_p):
    target, draft = models
    exact = _exact_joint(target, temperature, top_k, top_p)
    if top_k or top_p < 1.0:
        assert (exact == 0).any()  # the cut removes tokens the target would otherwise emit
    sampled = _sampled_joint(target, draft, temperature, top_k=top_k, top_p=top_p)
    assert sampled[exact == 0].sum() == 0  # the chi-square pools these cells: check them exactly
    assert _pvalue(sampled, exact) > 1e-3


def _keeps_rejected_drafts(draft_token_ids, draft_probs, target_probs, u_accept, u_target, num_draft):
    out, accepted = rejection_sample(draft_token_ids, draft_probs, target_probs, u_accept, u_target, num_draft)
    rows = torch.arange(out.shape[0])
    rejected = accepted < num_draft
    out[rows[rejected], accepted[rejected]] = draft_token_ids[rows[rejected], accepted[rejected]]
    return out, accepted


def _recovers_from_the_target(draft_token_ids, draft_probs, target_probs, u_accept, u_target, num_draft):
    out, accepted = rejection_sample(draft_token_ids, draft_probs, target_probs, u_accept, u_target, num_draft)
    rows = torch.arange(out.shape[0])
    rejected, at = accepted < num_draft, accepted
    out[rows[rejected], at[rejected]] = sample_from_probs(
        target_probs[rows[rejected], at[rejected]], u_target[rows[rejected], at[rejected]]
    )
    return out, accepted


def test_a_point_mass_proposer_keeps_the_target_distribution(models):
    target, draft = models
    assert _pvalue(_sampled_joint(target, draft, 1.0, point_mass=True), _exact_joint(target, 1.0)) > 1e-3


def test_the_static_shape_path_keeps_the_target_distribution(models):
    # padded rows, attention over the whole capacity, draft catch-ups rounded up: none may move a token
    target, draft = models
    sampled = _sampled_joint(target, draft, 0.8, static_shapes=True, model_free="ngram")
    assert _pvalue(sampled, _exact_joint(target, 0.8)) > 1e-3


@pytest.mark.parametrize("wrong_sampler", [_keeps_rejected_drafts, _recovers_from_the_target])
def test_the_same_test_rejects_a_wrong_sampler(models, monkeypatch, wrong_sampler):
    target, draft = models
    monkeypatch.setattr(decoding_engine, "rejection_sample", wrong_sampler)
    assert _pvalue(_sampled_joint(target, draft, 1.0), _exact_joint(target, 1.0)) < 1e-6


@pytest.mark.parametrize(("target_vocab", "draft_vocab"), [(VOCAB, VOCAB + 4), (VOCAB + 4, VOCAB)])
def test_models_with_embedding_tables_of_different_sizes_keep_the_target_distribution(target_vocab, draft_vocab):
    # the larger model's extra ids: the draft never proposes what the target cannot read, and reads
    # what the target emits past its own table as another id
    target, draft = lossless_pair(target_vocab, draft_vocab)
    joint = _exact_joint(target, 1.0)
    if target_vocab > VOCAB:
        assert joint[VOCAB:].sum() > 0.05  # the target does emit ids the draft cannot read
    assert _pvalue(_sampled_joint(target, draft, 1.0), joint) > 1e-3
