"""Modified rejection sampling, batched (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

Per row, draft token i is *accepted* with probability min(1, target_probs[i, d_i] / draft_probs[i, d_i]).
At the first rejection, the *recovered* token is sampled from norm(max(0, target_probs - draft_probs))
at that position and the row stops there; if all k draft tokens are accepted, the *bonus* token is
sampled from the target's distribution after the last draft token. A row's *output* for the step is
its accepted tokens plus the one recovered or bonus token, so it always gains at least one token, and
its tokens follow exactly the target's distribution.

Written so that no host sync happens: the first rejection is found with `cumprod`, and the single
position each row samples from is gathered, not looped over.
"""

from __future__ import annotations

import torch

from specq.decoding.sampling import sample_from_probs


def rejection_sample(
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    target_uniforms: torch.Tensor,
    num_draft: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output_token_ids [rows, k + 1], num_accepted [rows]).

    draft_token_ids [rows, k], draft_probs [rows, k, V], target_probs [rows, k + 1, V],
    accept_uniforms [rows, k] and target_uniforms [rows, k + 1] in (0, 1). Row b takes only its
    first `num_draft[b] <= k` draft tokens (fewer where it needs fewer tokens), so that it decodes
    exactly as it would in a batch of its own.
    Row b's output is `output_token_ids[b, : num_accepted[b] + 1]`; later entries are padding.
    """
    rows, k = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    assert draft_probs.shape == (rows, k, vocab), (draft_probs.shape, (rows, k, vocab))
    assert target_probs.shape == (rows, k + 1, vocab)

    index = draft_token_ids.unsqueeze(-1)  # [rows, k, 1]
    draft_token_probs = draft_probs.gather(-1, index).squeeze(-1)  # [rows, k]
    target_token_probs = target_probs[:, :k].gather(-1, index).squeeze(-1)  # [rows, k]
    # u < target / draft, written without the division. Strict: a token the target gives probability 0
    # is never accepted, not even one its draft gave probability 0 too (0 <= 0 would keep it), and a
    # token of draft probability 0 that the target allows is accepted, as min(1, target / 0) says.
    positions = torch.arange(k + 1, device=draft_token_ids.device)
    # A draft distribution that is not finite (a broken draft model) proposes nothing from there on:
    # its token is never accepted, and the residual there is the target's own distribution (as when the
    # row drafted fewer tokens), so the output still follows the target alone.
    usable = torch.isfinite(draft_probs.sum(dim=-1))  # [rows, k]
    proposed = (positions[:k] < num_draft.unsqueeze(1)) & usable  # [rows, k]
    accepted = (accept_uniforms * draft_token_probs < target_token_probs) & proposed  # [rows, k]
    num_accepted = accepted.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [rows]

    # The one distribution each row samples from: the residual at its first rejection, or, after k
    # acceptances, the target itself (the draft's probabilities past position k are taken as zero).
    at = num_accepted.view(rows, 1, 1).expand(rows, 1, vocab)  # [rows, 1, V]
    target_at = target_probs.gather(1, at).squeeze(1)  # [rows, V]
    padded_draft_probs = torch.nn.functional.pad(draft_probs, (0, 0, 0, 1))  # [rows, k + 1, V]
    proposed_at = torch.nn.functional.pad(proposed, (0, 1)).gather(1, num_accepted.unsqueeze(1))  # [rows, 1]
    # where, not a product: 0 x NaN is NaN
    draft_at = torch.where(proposed_at, padded_draft_probs.gather(1, at).squeeze(1), 0.0)  # [rows, V]
    residual = (target_at - draft_at).clamp_min_(0.0)  # [rows, V]
    # A zero residual means target == draft there, where a rejection has probability zero; it can only
    # come from rounding, and then the target distribution is the right fallback.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target_at)
    uniform_at = target_uniforms.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [rows]
    recovered_or_bonus = sample_from_probs(residual, uniform_at)  # [rows]

    padded_drafts = torch.nn.functional.pad(draft_token_ids, (0, 1))  # [rows, k + 1]
    output_token_ids = torch.where(
        positions < num_accepted.unsqueeze(1), padded_drafts, recovered_or_bonus.unsqueeze(1)
    )
    return output_token_ids, num_accepted


def greedy_accept(
    draft_token_ids: torch.Tensor, target_argmax: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept while the target's argmax equals the draft token.

    draft_token_ids [rows, k], target_argmax [rows, k + 1], num_draft [rows] as in `rejection_sample`.
    The output is the target's own greedy tokens, `target_argmax[b, : num_accepted[b] + 1]`
    (accepted tokens equal them by definition).
    """
    k = draft_token_ids.shape[1]
    proposed = torch.arange(k, device=draft_token_ids.device) < num_draft.unsqueeze(1)  # [rows, k]
    matches = (draft_token_ids == target_argmax[:, :k]) & proposed  # [rows, k]
    num_accepted = matches.to(torch.int64).cumprod(dim=-1).sum(dim=-1)  # [rows]
    return target_argmax, num_accepted
