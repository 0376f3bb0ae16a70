"""Sampling pieces: counter-based uniforms, temperature / top-k / top-p, inverse-CDF sampling."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import kstest

from specq.decoding.sampling import SamplingTensors, Stream, counter_uniforms, logits_to_probs, sample_from_probs
from specq.decoding.types import SamplingParams
from specq.limits import MIN_SAMPLING_TEMPERATURE


def _sampling(temperature, top_p, top_k, seeds=None):
    n = len(temperature)
    params = [
        SamplingParams(temperature=t, top_p=p, top_k=k) for t, p, k in zip(temperature, top_p, top_k, strict=True)
    ]
    return SamplingTensors.build(params, seeds or list(range(n)), torch.device("cpu"))


def test_counter_uniforms_are_uniform_and_independent_across_seeds_positions_streams():
    seeds = torch.arange(2000, dtype=torch.int64) * 7919 + 2**40
    positions = torch.arange(50).expand(2000, 50)
    u = counter_uniforms(seeds, positions, Stream.DRAFT)
    assert u.min() > 0 and u.max() < 1
    assert kstest(u.flatten().numpy(), "uniform").pvalue > 1e-3
    v = counter_uniforms(seeds, positions, Stream.ACCEPT)
    assert abs(torch.corrcoef(torch.stack([u.flatten(), v.flatten()]))[0, 1]) < 0.01
    shifted = counter_uniforms(seeds, positions + 1, Stream.DRAFT)
    assert torch.equal(u[:, 1:], shifted[:, :-1])  # a function of (seed, position) alone
    assert not torch.equal(u[0], u[1])


def test_counter_uniforms_do_not_depend_on_the_batch():
    seeds = torch.tensor([5, 2**62 + 3, 17])
    positions = torch.tensor([[10, 11], [3, 4], [0, 1]])
    together = counter_uniforms(seeds, positions, Stream.TARGET)
    alone = counter_uniforms(seeds[1:2], positions[1:2], Stream.TARGET)
    assert torch.equal(together[1:2], alone)


def test_temperature_and_greedy_rows():
    logits = torch.tensor([[[2.0, 1.0, 0.0]], [[2.0, 1.0, 0.0]], [[0.0, 3.0, 3.0]]])
    probs = logits_to_probs(logits, _sampling([1.0, 0.5, 0.0], [1.0] * 3, [0] * 3))
    assert torch.allclose(probs[0, 0], torch.tensor([2.0, 1.0, 0.0]).softmax(-1))
    assert torch.allclose(probs[1, 0], torch.tensor([4.0, 2.0, 0.0]).softmax(-1))
    assert probs[2, 0].tolist() == [0.0, 1.0, 0.0]  # greedy: one-hot on the first maximum


def test_a_temperature_below_the_sampling_minimum_is_greedy():
    # logits / 1e-30 overflow: the one rule (SamplingParams.greedy) makes such a row one-hot on its argmax
    assert SamplingParams(temperature=1e-30).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=MIN_SAMPLING_TEMPERATURE).greedy
    logits = torch.tensor([[[0.0, 3.0, 2.0]], [[5.0, 1.0, 0.0]]])
    probs = logits_to_probs(logits, _sampling([1e-30, 1e-300], [1.0] * 2, [0] * 2))
    assert probs[:, 0].tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_top_k_and_top_p_match_a_reference():
    torch.manual_seed(0)
    logits = torch.randn(4, 3, 50)
    top_p, top_k = [1.0, 0.7, 1.0, 0.5], [0, 0, 5, 10]
    probs = logits_to_probs(logits, _sampling([1.0] * 4, top_p, top_k))
    for row in range(4):
        for t in range(3):
            expected = truncated_reference(logits[row, t], top_p[row], top_k[row])
            assert torch.allclose(probs[row, t], expected, atol=1e-6), (row, t)


def truncated_reference(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    order = logits.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k else order
    probs = logits[keep].softmax(-1).tolist()
    kept, mass = [], 0.0
    for token, p in zip(keep, probs, strict=True):
        if top_p < 1.0 and mass >= top_p:
            break
        kept.append(token)
        mass += p
    out = torch.full_like(logits, float("-inf"))
    out[kept] = logits[kept]
    return out.softmax(-1)


def test_sample_from_probs_follows_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3]).expand(40_000, 4)
    tokens = sample_from_probs(probs, torch.rand(40_000, generator=torch.Generator().manual_seed(0)))
    frequencies = torch.bincount(tokens, minlength=4).float() / 40_000
    assert frequencies[1] == 0
    assert torch.allclose(frequencies, probs[0], atol=0.01)


def test_uniforms_stay_strictly_inside_zero_one_for_every_hash_value():
    from specq.decoding.sampling import UNIFORM_BITS, bits_to_uniforms

    # every value the construction can take: each distinct (so exact), none 0.0, none 1.0
    grid = torch.arange(1 << UNIFORM_BITS, dtype=torch.int64) << (32 - UNIFORM_BITS)
    for low_bits in (0, (1 << (32 - UNIFORM_BITS)) - 1):
        u = bits_to_uniforms(grid | low_bits)
        assert u.dtype == torch.float32
        assert u.min().item() == 2.0**-24 and u.max().item() == 1.0 - 2.0**-24
        assert torch.unique(u).numel() == 1 << UNIFORM_BITS
    # why 23 bits: with 24, the largest value rounds up to exactly 1.0 in float32
    assert ((torch.tensor(2**24 - 1, dtype=torch.float32) + 0.5) * 2.0**-24).item() == 1.0


@pytest.mark.parametrize("uniform", [0.0, 2.0**-24, 0.5, 1.0 - 2.0**-24, 1.0])
def test_sample_from_probs_never_returns_a_zero_probability_token_even_at_the_extremes(uniform):
    weights = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 0.0, 1e-30, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    tokens = sample_from_probs(weights, torch.full((3,), uniform))
    assert tokens[0].item() in (1, 3) and tokens[1].item() == 3 and tokens[2].item() == 0


def test_top_k_1_samples_the_argmax_whatever_the_uniform():
    logits = torch.randn(4, 1, 50, generator=torch.Generator().manual_seed(3))
    sampling = _sampling([1.0] * 4, [1.0] * 4, [1] * 4, [0] * 4)
    probs = logits_to_probs(logits, sampling)
    for uniform in (0.0, 1.0 - 2.0**-24, 1.0):
        tokens = sample_from_probs(probs[:, 0], torch.full((4,), uniform))
        assert torch.equal(tokens, logits[:, 0].argmax(-1))
