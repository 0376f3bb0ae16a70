"""From logits to probabilities and tokens, per row, without a host sync.

Randomness is counter-based: the uniform a row draws for a purpose (draft sample, acceptance test,
target sample) at a sequence position is a hash of (request seed, position, purpose). A request's
draws therefore do not depend on which batch it shares or on the order of kernel launches, and a
request retried on another worker with the same seed and the same k schedule draws the same numbers.
Each position's numbers decide that position once; numbers drawn for discarded draft positions are
reused for the position's final decision, which is sound because nothing kept depended on them.

Tokens are sampled by inverse CDF (one uniform per token: `searchsorted` over the cumulative
probabilities), which needs no `torch.multinomial` (a host sync on CUDA) and no vocabulary-sized
noise; tokens of probability zero are never chosen.

Reproducible sampling (`DecodingConfig.sampling == "reproducible"`) samples instead with the
exponential race, argmax_v probs[v] / E_v with E_v ~ Exp(1) (the Gumbel-max trick), where E_v is a
hash of (request seed, position, token id): a pure function of where the token would go and which
token it is, never of the draw order. The draft races on its own probabilities with the same noise,
so the two are coupled (drafter-invariant speculative decoding: Daliri, Musco and Suresh 2024, "Coupling without
Communication and Drafter-Invariant Speculative Decoding"): a draft token is accepted iff it is the
target's race winner, and every emitted token is the target's race winner, so a seeded request
decodes to the same tokens whatever the batch, the k schedule or the draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import torch

from specq.decoding.types import SamplingParams

_MASK16 = 0xFFFF
_MASK32 = 0xFFFFFFFF


class Stream(IntEnum):
    """What a uniform is for; each purpose gets independent numbers at the same position."""

    DRAFT = 1  # sampling a draft token
    ACCEPT = 2  # the acceptance test of a draft token
    TARGET = 3  # sampling a recovered, bonus or plain (non-speculative) token
    RACE = 4  # the per-token noise of reproducible sampling (draft and target share it)


def _mul32(x: torch.Tensor, factor: int) -> torch.Tensor:
    # (x * factor) mod 2**32 in 16-bit halves, so no int64 product overflows.
    low = (x & _MASK16) * factor
    high = (((x >> 16) * factor) & _MASK16) << 16
    return (low + high) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' `lowbias32` integer hash: a bijection on 32-bit values with good avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


# A float32 significand holds 24 bits, so (n + 0.5) / 2**23 is exact for every 23-bit n: the uniforms
# are the 2**23 midpoints of a grid on (0, 1), the smallest 2**-24 and the largest 1 - 2**-24. With 24
# bits, n + 0.5 needs 25 and the largest value rounds up to exactly 1.0 (once in 2**24 draws).
UNIFORM_BITS = 23


def bits_to_uniforms(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hash values [any shape] int64 -> float32 uniforms strictly inside (0, 1), by construction."""
    return ((bits >> (32 - UNIFORM_BITS)).to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def _seed_keys(seeds: torch.Tensor, stream: Stream) -> torch.Tensor:
    """[rows] int64 seeds -> [rows] 32-bit keys, one independent key per (seed, stream)."""
    return _mix32((seeds & _MASK32) ^ _mix32(((seeds >> 32) & _MASK32) ^ _mix32(torch.full_like(seeds, stream))))


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: Stream) -> torch.Tensor:
    """Uniforms in (0, 1), one per (row, position): `seeds` [rows] int64, `positions` [rows, T] int64."""
    key = _seed_keys(seeds, stream)  # [rows]
    bits = _mix32(_mix32(key[:, None] ^ (positions & _MASK32)) ^ 0x5BD1E995)  # [rows, T]
    return bits_to_uniforms(bits)


def race_exponentials(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise [rows, T, vocab] float32, one per (seed, position, token id): `seeds` [rows] int64,
    `positions` [rows, T] int64. Strictly positive and finite (from uniforms strictly inside (0, 1)).

    Two hash rounds per element: one keyed by (seed, position) on the token id, then one more keyed by an
    independent (seed, position) hash, so two positions whose keys differ in low bits still get unrelated
    noise rather than the same numbers over permuted token ids."""
    key = _seed_keys(seeds, Stream.RACE)  # [rows]
    at = _mix32(key[:, None] ^ (positions & _MASK32))  # [rows, T]
    salt = _mix32(at ^ 0x5BD1E995)  # [rows, T]
    token_ids = torch.arange(vocab, device=seeds.device)  # [V]
    bits = _mix32(_mix32(at[:, :, None] ^ token_ids) ^ salt[:, :, None])  # [rows, T, V]
    return -torch.log(bits_to_uniforms(bits))


def race(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """The exponential race: argmax over the last axis of probs / exponentials, both [..., V] -> [...].

    P(winner = v) = probs[v] / sum(probs) exactly; a token of probability 0 never wins (0 / E = 0 while
    some positive weight scores above 0). Greedy rows (one-hot probs) win their argmax."""
    return (probs / exponentials).argmax(dim=-1)


def race_sample(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Reproducible sampling: the race winner of `probs` [rows, T, V] at `positions` [rows, T] under the
    noise of `seeds` [rows] -> [rows, T] int64. The same (seed, position) always draws the same noise, so
    a draft and the target racing at one position are coupled."""
    return race(probs, race_exponentials(seeds, positions, probs.shape[-1]))


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings on the device, plus host flags that pick the cheap paths."""

    temperature: torch.Tensor  # [rows] float32; 1.0 where greedy (unused there)
    top_p: torch.Tensor  # [rows] float32
    top_k: torch.Tensor  # [rows] int64, 0: off
    greedy: torch.Tensor  # [rows] bool
    seeds: torch.Tensor  # [rows] int64
    all_greedy: bool
    any_greedy: bool
    any_truncation: bool  # some sampled row uses top-p or top-k
    reproducible: bool = False  # sample with the exponential race (`race_sample`), not by inverse CDF

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams | None],
        seeds: Sequence[int],
        device: torch.device,
        reproducible: bool = False,
    ) -> SamplingTensors:
        """The tensors of rows decoding with `params` (None: an empty row, decoded as greedy) and `seeds`."""
        rows = [p or _EMPTY_ROW for p in params]
        greedy = [p.greedy for p in rows]
        return cls(
            temperature=torch.tensor(
                [1.0 if p.greedy else p.temperature for p in rows], dtype=torch.float32, device=device
            ),
            top_p=torch.tensor([p.top_p for p in rows], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in rows], dtype=torch.int64, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            seeds=torch.tensor(list(seeds), dtype=torch.int64, device=device),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            any_truncation=any(not p.greedy and (p.top_p < 1.0 or p.top_k > 0) for p in rows),
            reproducible=reproducible,
        )


_EMPTY_ROW = SamplingParams(max_tokens=1, temperature=0.0)  # what a row with no request decodes as


def _truncate(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p (nucleus) set; at least one token survives."""
    # logits: [rows, T, V]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [rows, T, V]
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None, None]  # [rows, 1, 1]
    drop = rank >= k  # [rows, 1, V] broadcast over T
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # [rows, T, V]
    nucleus = top_p[:, None, None]
    drop = drop | ((mass_before >= nucleus) & (nucleus < 1.0))
    drop[..., 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def logits_to_probs(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """Temperature, then top-k and top-p, then softmax; greedy rows become one-hot on their argmax."""
    # logits: [rows, T, V] (any float dtype) -> probs [rows, T, V] float32
    logits = logits.float()
    scaled = logits / sampling.temperature[:, None, None]
    if sampling.any_truncation:
        scaled = _truncate(scaled, sampling.top_k, sampling.top_p)
    probs = scaled.softmax(dim=-1)
    if sampling.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(sampling.greedy[:, None, None], one_hot, probs)
    return probs


def sample_from_probs(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample of each row of (unnormalised, non-negative) `weights` [..., V] with `uniforms` [...].

    Never a token of weight zero, whatever the uniform: the threshold is kept strictly inside
    (0, total), and the first cumulative weight above it is one that a positive weight raised.
    A row that is no distribution (NaN or inf, from a broken model) gets token 0, an id every model
    reads: a search through NaN lands past the vocabulary, on an id the target may not have."""
    cdf = weights.cumsum(dim=-1)  # [..., V]
    total = cdf[..., -1:]  # [..., 1]
    # u * total rounds up to total for u near 1 (or u == 1 from another source): stay one step below
    below_total = torch.nextafter(total, torch.zeros_like(total))
    threshold = torch.minimum(uniforms.unsqueeze(-1) * total, below_total)  # [..., 1]
    token = torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp_(max=weights.shape[-1] - 1)
    return torch.where(torch.isfinite(total).squeeze(-1), token, 0)


def first_nonfinite(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first position whose logits are no distribution, [rows, T, V] -> [rows] int64 (T: none).

    Not finite: a NaN or +inf anywhere, or every logit -inf (the softmax of each is NaN). A position's
    max is then not finite, so one reduction finds them all; -inf logits beside finite ones (a padded
    vocabulary) are fine. The first bad position by `cumprod`, without a host sync."""
    finite = torch.isfinite(logits.amax(dim=-1))  # [rows, T]
    return finite.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def check_probs(probs: torch.Tensor) -> None:
    """`strict` mode's check of a distribution [..., V]: non-negative, summing to 1. Distributions that
    are not finite are a broken model's, not an engine bug: the engine fails a target's row for them
    (`first_nonfinite`) and rejects a draft's tokens (decoding/rejection.py), so they are skipped here."""
    total = probs.sum(-1)  # [...]
    finite = torch.isfinite(total)  # [...]
    total = total[finite]
    assert torch.allclose(total, torch.ones_like(total), atol=1e-4), "probabilities do not sum to 1"
    assert bool((probs[finite] >= 0).all()), "negative probability"
