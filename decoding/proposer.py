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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from specq.decoding.batch import Admission, BatchState, RowState

if TYPE_CHECKING:
    from specq.decoding.stats import EngineStats


class Proposer(RowState, Protocol):
    max_k: int  # the most draft tokens one `propose` returns per row

    def admit(self, batch: BatchState, admission: Admission, stats: EngineStats) -> None:
        """New rows' prompts were just written into `batch`: read them (a draft model prefills its cache).

        Sequences then hold only their prompt; a row's first proposal follows its last prompt token."""
        ...

    def propose(self, batch: BatchState, k: int, stats: EngineStats) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens for every row, following `batch.token_ids[:, :seq_lens]`.

        Returns draft_token_ids [rows, k] int64 and draft_probs [rows, k, vocab] float32 (each row's
        distribution at each position, under `batch.sampling`), or None for draft_probs when
        `batch.sampling.all_greedy`. Rows that are not live get tokens that are ignored. No host sync.
        """
        ...

    def advance(self, batch: BatchState) -> None:
        """The step appended each row's output to `batch` (`seq_lens` moved on): roll back per row what
        followed a rejected draft token."""
        ...
