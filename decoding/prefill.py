"""The target's prefill of newly admitted rows, which gives each its first output token.

The prefill reads the whole prompt and returns the target's logits at its last token, so the first
output token costs no step of its own: with short completions (labels, 20-token answers) that step
would be a large share of the work. A model that cannot return chosen positions' logits alone reads
all but the last prompt token instead, and the first step verifies that token with the first draft
tokens.

Less is read where rows already hold some of it:
- rows with one prompt (a line's `n` choices) share one prefill: it runs for the first of them, whose
  cache columns the others copy;
- a row whose prompt starts with a long head that a row of the batch holds copies that head's columns
  and prefills only the rest (decoding/prefix_reuse.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from specq.decoding.batch import Admission, BatchState
from specq.decoding.hf_model import RaggedLM
from specq.decoding.proposer import Proposer
from specq.decoding.stats import EngineStats


class TargetPrefill:
    """Prefills admitted rows with `lm`, logits padded to `vocab_size` (the larger of two models')."""

    def __init__(self, lm: RaggedLM, vocab_size: int) -> None:
        self.lm = lm
        self.vocab_size = vocab_size
        self.emits_first = lm.keeps_logits  # the prefill returns each row's first-token logits

    def __call__(
        self,
        batch: BatchState,
        admission: Admission,
        prompts: list[tuple[int, ...]],
        *,
        proposer: Proposer | None,
        stats: EngineStats,
    ) -> torch.Tensor | None:
        """Run the target over each admitted prompt and return its logits at each prompt's last token
        [n, V] (None where the model cannot return them alone: see the module's docstring); then
        `proposer` takes the new rows (a draft model reads their prompts at its first proposal)."""
        started = time.perf_counter()
        shared = _shared_prompts(prompts)
        full = admission
        if shared is not None:
            admission = _select(admission, shared.leaders)
        first_logits = None
        if self.emits_first:
            leaders = [tuple(prompts[i]) for i in (range(len(prompts)) if shared is None else shared.leaders)]
            prompt_ids, starts = self._unshared_tails(batch, admission, leaders, stats)  # [n, width]
            lengths = admission.prompt_lens - (0 if starts is None else starts)  # [n]
            first_logits, forwards = self.lm.prefill_rows(
                batch.target_cache,
                admission.rows,
                prompt_ids,
                lengths,
                self.vocab_size,
                starts=starts,
                last_logits=True,
            )  # [n, V]
            stats.target_forwards += forwards
        else:
            lengths = admission.prompt_lens - 1  # [n] the last prompt token is verified by the first step
            reading = np.flatnonzero(lengths > 0)
            if reading.size:
                _, forwards = self.lm.prefill_rows(
                    batch.target_cache,
                    admission.rows[reading],
                    admission.prompt_ids[torch.from_numpy(reading).to(batch.device)],
                    lengths[reading],
                    self.vocab_size,
                )
                stats.target_forwards += forwards
        stats.prefill_tokens += int(lengths.sum())
        if proposer is not None:
            proposer.admit(batch, full, stats)
        if shared is not None:
            first_logits = _copy_to_followers(batch, full, shared, first_logits)
        if self.emits_first:  # every prompt column written (without, the last one is written by a step)
            batch.held_prompts.record(full.rows.tolist(), [tuple(prompt) for prompt in prompts])
        stats.time_prefill_s += time.perf_counter() - started
        return first_logits

    def _unshared_tails(
        self, batch: BatchState, admission: Admission, prompts: list[tuple[int, ...]], stats: EngineStats
    ) -> tuple[torch.Tensor, np.ndarray | None]:
        """What the prefill of `admission`'s rows (prompts `prompts`) must run: the prompts' ids [n, width]
        and None, or, where rows hold a long head of them (decoding/prefix_reuse.py), the ids after it,
        right-padded, and where each row's starts [n], its head copied into it first."""
        heads = batch.held_prompts.lend(batch.target_cache, admission.rows, admission.rows_t, prompts)
        if not heads.any():
            return admission.prompt_ids, None
        tails = [prompt[head:] for prompt, head in zip(prompts, heads.tolist(), strict=True)]
        width = max(map(len, tails))
        padded = [list(tail) + [0] * (width - len(tail)) for tail in tails]
        stats.prompt_tokens_reused += int(heads.sum())
        return torch.tensor(padded, device=batch.device), heads


@dataclass(frozen=True)
class _SharedPrompts:
    """Admitted rows grouped by prompt: the first row of each prompt (its leader) and each row's group."""

    leaders: np.ndarray  # [u] positions in the admission of each distinct prompt's first row
    inverse: np.ndarray  # [n] each row's index into `leaders`


def _shared_prompts(prompts: list[tuple[int, ...]]) -> _SharedPrompts | None:
    """The rows that share a prompt with an earlier row, or None when every prompt is distinct."""
    group_of: dict[tuple[int, ...], int] = {}
    leaders: list[int] = []
    inverse = []
    for position, prompt in enumerate(prompts):
        group = group_of.get(prompt)
        if group is None:
            group = group_of[prompt] = len(leaders)
            leaders.append(position)
        inverse.append(group)
    if len(leaders) == len(prompts):
        return None
    return _SharedPrompts(np.array(leaders, np.int64), np.array(inverse, np.int64))


def _select(admission: Admission, positions: np.ndarray) -> Admission:
    """The admission of the rows at `positions` alone."""
    index = torch.from_numpy(positions).to(admission.rows_t.device)
    return Admission(
        rows=admission.rows[positions],
        rows_t=admission.rows_t[index],
        prompt_ids=admission.prompt_ids[index],
        prompt_lens=admission.prompt_lens[positions],
    )


def _copy_to_followers(
    batch: BatchState, full: Admission, shared: _SharedPrompts, first_logits: torch.Tensor | None
) -> torch.Tensor | None:
    """Copy each leader's prompt columns into the rows that share its prompt; the leaders' first-token
    logits [u, V] spread to all the admitted rows [n, V]."""
    device = batch.device
    followers = np.flatnonzero(shared.leaders[shared.inverse] != np.arange(len(full.rows)))  # [f]
    source = torch.from_numpy(full.rows[shared.leaders[shared.inverse[followers]]]).to(device)
    batch.target_cache.copy_rows(source, full.rows_t[torch.from_numpy(followers).to(device)], full.prompt_ids.shape[1])
    return None if first_logits is None else first_logits[torch.from_numpy(shared.inverse).to(device)]  # [n, V]
