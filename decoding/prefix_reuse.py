"""Prefill only the part of a prompt that no row of the batch already holds.

A batch job's prompts often share a long head: one template filled in thousands of times, one system
prompt, one few-shot preamble. The target's keys and values of a prompt's first m tokens depend on
those m tokens alone (causal attention; a row's positions are its cache columns, decoding/kv_cache.py),
so a row whose prompt starts with m tokens another row holds can take those m columns (copied from
that row, or kept: a row refilled right after its request ended holds its last prompt still) and
prefill from column m. On a templated job at batch 1 the prefill was about 15% of a target-only pass
(docs/benchmark-log/2026-12.md, "A prompt's head that a row holds is not prefilled again"); with the head
reused, only each prompt's own tail is run.

Which rows hold what is known on the host: each row's prompt, recorded at its prefill, for as long as
its columns are intact. A live row's prompt columns are never written again (a step writes at the
row's length and after). A row whose request ended is stepped at length 1 while it idles, which
writes over its first columns, so its prompt is forgotten at the next step; admission comes before
that step, so the row refilled at once keeps it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeGuard

import numpy as np
import torch

if TYPE_CHECKING:
    from specq.decoding.kv_cache import RaggedKVCache

# Shorter shared heads are not reused: a few common tokens (a BOS, "def ") would save next to nothing and
# make every prompt's prefill an extension of another row's.
MIN_SHARED_TOKENS = 16


class HeldPrompts:
    """The prompt whose keys and values each row of the target's cache holds (None: none intact)."""

    def __init__(self) -> None:
        self.prompts: list[tuple[int, ...] | None] = []  # [rows]; read it, change it through the methods
        # (prompt, row) of the held prompts long enough to lend a head, sorted: the held prompt sharing
        # the longest head with a prompt is next to where that prompt would sort, so a lookup is a
        # bisection and two comparisons, not one comparison a row (O(admitted x rows) at admission)
        self._sorted: list[tuple[tuple[int, ...], int]] = []

    def record(self, rows: Sequence[int], prompts: Sequence[tuple[int, ...]]) -> None:
        for row, prompt in zip(rows, prompts, strict=True):
            self._hold(row, prompt)

    def forget_idle(self, live: np.ndarray) -> None:
        """Rows not in `live` are about to be stepped idle, over their first columns."""
        if live.size == len(self.prompts):  # the usual step: every row live
            return
        kept = set(live.tolist())
        for row, prompt in enumerate(self.prompts):
            if prompt is not None and row not in kept:
                self._hold(row, None)

    def forget(self, rows: Sequence[int]) -> None:
        """These rows' columns no longer hold their prompts."""
        for row in rows:
            self._hold(row, None)

    def resize(self, rows: int, keep: np.ndarray | None) -> None:
        kept = self.prompts if keep is None else [self.prompts[i] for i in keep]
        self.prompts = kept[:rows] + [None] * (rows - len(kept[:rows]))
        self._sorted = sorted((prompt, row) for row, prompt in enumerate(self.prompts) if _can_lend(prompt))

    def _hold(self, row: int, prompt: tuple[int, ...] | None) -> None:
        held = self.prompts[row]
        if _can_lend(held):
            del self._sorted[bisect.bisect_left(self._sorted, (held, row))]
        self.prompts[row] = prompt
        if _can_lend(prompt):
            bisect.insort(self._sorted, (prompt, row))

    def lend(
        self, cache: RaggedKVCache, rows: np.ndarray, rows_t: torch.Tensor, prompts: Sequence[tuple[int, ...]]
    ) -> np.ndarray:
        """`shared_heads` of the prompts about to be prefilled into `rows` (`rows_t` on the device), each head
        held by another row copied into its row in `cache`: [n] the columns each row now holds."""
        holders, heads = self.shared_heads(rows, prompts)
        lent = np.flatnonzero(holders != rows)  # [m] rows that take another row's head
        if lent.size:
            device = rows_t.device
            sources = torch.from_numpy(holders[lent]).to(device)
            cache.copy_rows(sources, rows_t[torch.from_numpy(lent).to(device)], int(heads[lent].max()))
        return heads

    def shared_heads(self, rows: np.ndarray, prompts: Sequence[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
        """For prompts about to be prefilled into `rows` [n]: the row holding the longest head of each
        (the row itself where its own is longest) and that head's length in tokens ([n] each; 0 where
        no held head is `MIN_SHARED_TOKENS` long). A row being refilled lends what it holds before the
        refill: the caller copies every borrowed head in one gather, before any row is written. A head
        stops one token short of its prompt, whose last token's logits the prefill must compute."""
        donors, lengths = rows.copy(), np.zeros(len(rows), np.int64)
        for i, (row, prompt) in enumerate(zip(rows.tolist(), prompts, strict=True)):
            limit = len(prompt) - 1
            if limit < MIN_SHARED_TOKENS or not self._sorted:
                continue
            own = self.prompts[row]
            best = _common_head(prompt, own, limit) if own is not None else 0
            at = bisect.bisect_left(self._sorted, (prompt,))
            for held, holder in self._sorted[max(at - 1, 0) : at + 1]:
                shared = _common_head(prompt, held, limit)
                if shared > best:
                    donors[i], best = holder, shared
            lengths[i] = best
        too_short = lengths < MIN_SHARED_TOKENS
        donors[too_short], lengths[too_short] = rows[too_short], 0
        return donors, lengths


def _can_lend(prompt: tuple[int, ...] | None) -> TypeGuard[tuple[int, ...]]:
    return prompt is not None and len(prompt) >= MIN_SHARED_TOKENS


def _common_head(a: tuple[int, ...], b: tuple[int, ...], limit: int) -> int:
    """The length of the longest common prefix of `a` and `b`, at most `limit`: a binary search on slices,
    whose comparisons run in C."""
    low, high = 0, min(len(a), len(b), limit)
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
