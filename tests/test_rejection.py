"""The rejection sampler alone: crafted cases, and its output distribution by a chi-square test with power."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specq.decoding.rejection import greedy_accept, rejection_sample
from specq.decoding.sampling import sample_from_probs


def _one_row(draft_tokens, draft_probs, target_probs, accept_u, target_u, num_draft=None):
    draft_token_ids = torch.tensor([draft_tokens])
    k = len(draft_tokens)
    return rejection_sample(
        draft_token_ids,
        torch.tensor([draft_probs], dtype=torch.float32),
        torch.tensor([target_probs], dtype=torch.float32),
        torch.tensor([accept_u], dtype=torch.float32),
        torch.tensor([target_u], dtype=torch.float32),
        torch.tensor([k if num_draft is None else num_draft]),
    )


def test_draft_equal_to_target_is_always_accepted_with_a_bonus():
    probs = [[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]]
    target = [*probs, [0.0, 0.0, 1.0]]
    out, accepted = _one_row([1, 0], probs, target, [0.999, 0.999], [0.5, 0.5, 0.5])
    assert accepted.item() == 2
    assert out[0].tolist() == [1, 0, 2]  # the bonus comes from the target's last distribution


def test_token_the_target_never_produces_is_rejected_and_recovered_from_the_residual():
    draft = [[0.0, 1.0, 0.0]]
    target = [[0.7, 0.0, 0.3], [1.0, 0.0, 0.0]]
    out, accepted = _one_row([1], draft, target, [1e-6], [0.99, 0.5])
    assert accepted.item() == 0
    assert out[0, 0].item() == 2  # residual max(0, target - draft) = target here; u = 0.99 lands on token 2


def test_recovered_token_never_has_zero_residual():
    # target puts 0.5 on token 0 and 1, draft puts all on token 0: the residual is only token 1
    draft = [[1.0, 0.0, 0.0]]
    target = [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]
    for u in (0.01, 0.5, 0.99):
        out, accepted = _one_row([0], draft, target, [0.9], [u, 0.5])
        assert accepted.item() == 0 and out[0, 0].item() == 1


def test_acceptance_stops_at_the_first_rejection():
    draft = [[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]
    target = [[0.5, 0.5], [0.0, 1.0], [0.5, 0.5], [0.5, 0.5]]
    # position 1 rejects token 0 (target 0); position 2 would accept, but must not count
    out, accepted = _one_row([1, 0, 1], draft, target, [0.1, 0.1, 0.1], [0.5, 0.5, 0.5, 0.5])
    assert accepted.item() == 1
    assert out[0, :2].tolist() == [1, 1]


def test_num_draft_limits_a_row_to_fewer_draft_tokens():
    probs = [[0.1, 0.9], [0.1, 0.9]]
    out, accepted = _one_row([1, 1], probs, [*probs, [1.0, 0.0]], [0.01, 0.01], [0.5, 0.99, 0.5], num_draft=1)
    assert accepted.item() == 1
    # at position 1 the row proposed nothing, so it samples from the target (a bonus), not a residual
    assert out[0, 1].item() == 1


def test_greedy_accept_matches_the_target_argmax():
    draft = torch.tensor([[3, 4, 5], [3, 9, 5], [1, 4, 5]])
    target_argmax = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]])
    out, accepted = greedy_accept(draft, target_argmax, torch.tensor([3, 3, 2]))
    assert accepted.tolist() == [3, 1, 0]
    assert torch.equal(out, target_argmax)


def test_draft_token_of_probability_zero_for_both_models_is_rejected():
    # vLLM and transformers reject it too: u * 0 <= 0 would keep a token the target never produces
    out, accepted = _one_row([2], [[0.5, 0.5, 0.0]], [[0.6, 0.4, 0.0], [1.0, 0.0, 0.0]], [0.3], [0.5, 0.5])
    assert accepted.item() == 0
    assert out[0, 0].item() in (0, 1)


def test_draft_token_of_draft_probability_zero_the_target_allows_is_accepted():
    # min(1, target / 0) = 1: the target's own distribution decides, as in the paper
    out, accepted = _one_row([2], [[0.5, 0.5, 0.0]], [[0.3, 0.3, 0.4], [1.0, 0.0, 0.0]], [0.999], [0.5, 0.5])
    assert accepted.item() == 1 and out[0, :2].tolist() == [2, 0]


def test_greedy_rows_give_the_argmax_next_to_sampled_rows_whatever_the_uniforms():
    # In a mixed batch a greedy row goes through the sampler with one-hot target probabilities (vLLM's
    # and transformers' greedy-in-mixed-batch checks): it must come out as the argmax for any uniform,
    # the extremes included, whatever its draft proposed and whatever its neighbours do.
    generator = torch.Generator().manual_seed(3)
    rows, k, vocab = 64, 3, 10
    target_probs = torch.distributions.Dirichlet(torch.ones(vocab)).sample((rows, k + 1))  # [rows, k + 1, V]
    greedy = torch.arange(rows) % 2 == 0
    argmax = target_probs.argmax(-1)  # [rows, k + 1]
    one_hot = torch.nn.functional.one_hot(argmax, vocab).float()
    target_probs = torch.where(greedy.view(rows, 1, 1), one_hot, target_probs)
    draft_probs = torch.distributions.Dirichlet(torch.ones(vocab)).sample((rows, k))  # [rows, k, V]
    draft_token_ids = torch.randint(0, vocab, (rows, k), generator=generator)
    draft_token_ids[::4] = argmax[::4, :k]  # some greedy rows drafted the argmax, some did not
    extremes = torch.tensor([2.0**-24, 0.5, 1 - 2.0**-24])
    for u in extremes:
        out, accepted = rejection_sample(
            draft_token_ids,
            draft_probs,
            target_probs,
            torch.full((rows, k), float(u)),
            torch.full((rows, k + 1), float(u)),
            torch.full((rows,), k),
        )
        for row in greedy.nonzero().flatten().tolist():
            n = accepted[row].item()
            assert out[row, : n + 1].tolist() == argmax[row, : n + 1].tolist(), (row, u)


def test_rows_with_different_draft_counts_decode_as_they_would_alone():
    # vLLM's ragged spec-token lists: one batch mixes rows that proposed 0, 1, ..., k tokens
    generator = torch.Generator().manual_seed(4)
    rows, k, vocab = 40, 4, 7
    draft_probs = torch.distributions.Dirichlet(torch.ones(vocab)).sample((rows, k))
    target_probs = torch.distributions.Dirichlet(torch.ones(vocab)).sample((rows, k + 1))
    draft_token_ids = sample_from_probs(draft_probs, torch.rand(rows, k, generator=generator))
    u_accept, u_target = torch.rand(rows, k, generator=generator), torch.rand(rows, k + 1, generator=generator)
    num_draft = torch.arange(rows) % (k + 1)
    out, accepted = rejection_sample(draft_token_ids, draft_probs, target_probs, u_accept, u_target, num_draft)
    assert (accepted <= num_draft).all()
    for row in range(rows):
        n = int(num_draft[row])
        alone, alone_accepted = rejection_sample(
            draft_token_ids[row : row + 1, :n],
            draft_probs[row : row + 1, :n],
            target_probs[row : row + 1, : n + 1],
            u_accept[row : row + 1, :n],
            u_target[row : row + 1, : n + 1],
            torch.tensor([n]),
        )
        assert accepted[row] == alone_accepted[0], row
        assert out[row, : accepted[row] + 1].tolist() == alone[0, : alone_accepted[0] + 1].tolist(), row


def test_sample_from_probs_never_picks_zero_probability_tokens():
    weights = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]]).expand(1000, 5)
    uniforms = torch.linspace(1e-7, 1 - 1e-7, 1000)
    tokens = sample_from_probs(weights, uniforms)
    assert set(tokens.tolist()) == {1, 3}


# -- the distribution -------------------------------------------------------------------------------
VOCAB, K, ROWS = 6, 3, 200_000


def _random_dists(n):
    return torch.distributions.Dirichlet(torch.full((VOCAB,), 0.7)).sample((n,))


@pytest.fixture(scope="module")
def case():
    """Fixed per-position draft and target distributions that differ clearly."""
    torch.manual_seed(0)
    draft = _random_dists(K)  # [K, V]
    target = _random_dists(K + 1)  # [K + 1, V]
    return draft, target


def _simulate(case, sampler, seed=1):
    draft, target = case
    generator = torch.Generator().manual_seed(seed)
    draft_probs = draft.expand(ROWS, K, VOCAB).contiguous()
    target_probs = target.expand(ROWS, K + 1, VOCAB).contiguous()
    u_draft = torch.rand(ROWS, K, generator=generator)
    draft_token_ids = sample_from_probs(draft_probs, u_draft)
    u_accept = torch.rand(ROWS, K, generator=generator)
    u_target = torch.rand(ROWS, K + 1, generator=generator)
    return sampler(draft_token_ids, draft_probs, target_probs, u_accept, u_target, torch.full((ROWS,), K))


def _pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() / probs.double().sum() * counts.sum()
    return chisquare(counts.numpy(), expected.numpy()).pvalue


def _first_token_pvalue(case, sampler):
    _, target = case
    out, _ = _simulate(case, sampler)
    return _pvalue(torch.bincount(out[:, 0], minlength=VOCAB).double(), target[0])


def _second_token_pvalue(case, sampler):
    """Rows that accepted their first draft token: the second output token must follow target[1]."""
    _, target = case
    out, accepted = _simulate(case, sampler, seed=2)
    second = out[accepted >= 1, 1]
    return _pvalue(torch.bincount(second, minlength=VOCAB).double(), target[1])


def _keeps_rejected_drafts(draft_token_ids, draft_probs, target_probs, u_accept, u_target, num_draft):
    """Wrong: a rejected draft token is emitted instead of a recovered one."""
    out, accepted = rejection_sample(draft_token_ids, draft_probs, target_probs, u_accept, u_target, num_draft)
    rows = torch.arange(out.shape[0])
    rejected = accepted < draft_token_ids.shape[1]
    out[rows[rejected], accepted[rejected]] = draft_token_ids[rows[rejected], accepted[rejected]]
    return out, accepted


def _recovers_from_the_target(draft_token_ids, draft_probs, target_probs, u_accept, u_target, num_draft):
    """Wrong: the correction is sampled from the target alone, not from the residual."""
    out, accepted = rejection_sample(draft_token_ids, draft_probs, target_probs, u_accept, u_target, num_draft)
    rows = torch.arange(out.shape[0])
    rejected = accepted < draft_token_ids.shape[1]
    at = accepted[rejected]
    out[rows[rejected], at] = sample_from_probs(target_probs[rows[rejected], at], u_target[rows[rejected], at])
    return out, accepted


def _first_token_pvalue_with_ragged_drafts(case, sampler):
    """Rows proposing 0..K tokens in one batch: each group's first output token must follow target[0]."""
    draft, target = case
    generator = torch.Generator().manual_seed(3)
    draft_probs = draft.expand(ROWS, K, VOCAB).contiguous()
    target_probs = target.expand(ROWS, K + 1, VOCAB).contiguous()
    draft_token_ids = sample_from_probs(draft_probs, torch.rand(ROWS, K, generator=generator))
    num_draft = torch.arange(ROWS) % (K + 1)
    out, _ = sampler(
        draft_token_ids,
        draft_probs,
        target_probs,
        torch.rand(ROWS, K, generator=generator),
        torch.rand(ROWS, K + 1, generator=generator),
        num_draft,
    )
    return min(
        _pvalue(torch.bincount(out[num_draft == n, 0], minlength=VOCAB).double(), target[0]) for n in range(K + 1)
    )


def _bonus_from_the_residual(draft_token_ids, draft_probs, target_probs, u_accept, u_target, num_draft):
    """Wrong: a row that proposed fewer than k tokens and kept them all samples its bonus from the residual
    against the draft's padding, as if it had proposed a token there."""
    out, accepted = rejection_sample(draft_token_ids, draft_probs, target_probs, u_accept, u_target, num_draft)
    rows = ((accepted == num_draft) & (num_draft < draft_token_ids.shape[1])).nonzero().flatten()
    at = accepted[rows]
    residual = (target_probs[rows, at] - draft_probs[rows, at]).clamp_min(0.0)
    out[rows, at] = sample_from_probs(residual, u_target[rows, at])
    return out, accepted


def test_rows_proposing_different_counts_all_follow_the_target(case):
    assert _first_token_pvalue_with_ragged_drafts(case, rejection_sample) > 1e-3 / (K + 1)


def test_the_ragged_test_rejects_a_sampler_that_mistakes_padding_for_drafts(case):
    assert _first_token_pvalue_with_ragged_drafts(case, _bonus_from_the_residual) < 1e-6


def test_output_follows_the_target_distribution(case):
    assert _first_token_pvalue(case, rejection_sample) > 1e-3
    assert _second_token_pvalue(case, rejection_sample) > 1e-3


@pytest.mark.parametrize("wrong_sampler", [_keeps_rejected_drafts, _recovers_from_the_target])
def test_the_same_test_rejects_a_wrong_sampler(case, wrong_sampler):
    assert _first_token_pvalue(case, wrong_sampler) < 1e-6
