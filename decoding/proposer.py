"""The seam between the step and whatever proposes draft tokens (Leviathan et al. 2023, Algorithm 1's M_q).

The step (decoding/engine.py) asks a proposer for up to k draft tokens per row and, unless every row
is greedy, for the distribution each was drawn from (`draft_probs`); modified rejection sampling then
keeps the output lossless whatever the proposer is. So a proposer need not be a model: one that looks
tokens up (prompt lookup, n-grams) proposes a point mass, `draft_probs` one-hot on each proposed
token, and the acceptance test becomes u <= target_probs[token].

A proposer may keep per-row state (a draft model keeps a KV cache and how much of each row it has
seen); `BatchState` tells it when rows are added, moved or dropped (`resize`), and freed (`release`):
see `RowState`.
Target-only decoding has no proposer at all (k = 0 every step).

Each step the engine first asks every row what it `offer`s (how many draft tokens, and from which
proposer: a model-free proposer offers only what its match supports), picks k from those offers
(decoding/k_policy.py), then asks for the proposal itself with each row's own count.
Implementations: decoding/draft_model.py, decoding/model_free.py (prompt lookup, the suffix index,
and the hybrid of either with a draft model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from specq.decoding.batch import Admission, BatchState, RowState

if TYPE_CHECKING:
    from specq.decoding.stats import EngineStats


@dataclass
class Offer:
    """What each row would propose this step, host arrays over all rows (rows not live: 0)."""

    lengths: np.ndarray  # [rows] int64, the most draft tokens the row offers (0: none)
    sources: np.ndarray  # [rows] int64, the proposer each row's draft comes from (decoding.stats.PROPOSERS)


class Proposer(RowState, Protocol):
    max_k: int  # the most draft tokens one `propose` returns per row

    def admit(self, batch: BatchState, admission: Admission, stats: EngineStats) -> None:
        """New rows' prompts were just written into `batch`: take them (a draft model marks them to be read
        into its cache at its next proposal; prompt lookup starts each row's index).

        Sequences then hold only their prompt. The engine next appends each row's first token, sampled
        from the prefill, through `advance` (unless the target cannot return the last position's
        logits alone), so a row's first proposal usually follows that token."""
        ...

    def offer(self, batch: BatchState, live: np.ndarray, limits: np.ndarray) -> Offer:
        """Per row, up to `limits[row]` (<= max_k) draft tokens it could propose after its sequence."""
        ...

    def propose(
        self, batch: BatchState, k: int, num_draft_h: np.ndarray, stats: EngineStats
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to k draft tokens for every row (row b's first `num_draft_h[b]` count), following
        `batch.token_ids[:, :seq_lens]`, as the last `offer` said.

        Returns draft_token_ids [rows, k] int64 and draft_probs [rows, k, vocab] float32 (each row's
        distribution at each position, under `batch.sampling`; one-hot for a looked-up token), or None
        for draft_probs when no step reads them (all rows greedy, or reproducible sampling). Rows that
        are not live, and positions past a row's count, get tokens that are ignored.
        """
        ...

    def advance(self, batch: BatchState, output_ids: np.ndarray, emitted: np.ndarray) -> None:
        """The step appended each row's output to `batch` (`seq_lens` moved on): row b gained
        `output_ids[b, : emitted[b]]` (host copies). Roll back per row what followed a rejected draft token."""
        ...
