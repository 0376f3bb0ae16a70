"""Prefill rows in groups of similar length, split where the padding saved pays for another forward.

A prefill runs its rows right-padded to the longest of them. On ragged prompts that padding is much
of the work: the held-out code prompts of `specq bench` (49 to 134 tokens, median 73) padded four
16-row prefills to 7,552 tokens for 4,878 real ones. A prefill per row wastes nothing but pays a
forward's fixed cost (the model's Python and kernel launches) per row. Between the two: sort the rows
by length and cut the sorted run into groups, each costing one forward's overhead plus its rows times
its longest length, at the cuts that make the sum least (dynamic programming over the sorted
lengths, O(n^2) for n rows prefilled together; a partition into contiguous runs of the sorted
lengths is optimal for this cost, since a group's cost depends only on its longest row).

The overhead is measured, in tokens of the model: each prefill's time is fitted, by least squares
over the model's prefills so far, as `overhead + per_token * padded_tokens`, and their ratio is the
overhead in tokens. It differs by model and device (on the 2-core CPU, 154 tokens for the demo's
draft model, whose tokens cost a tenth of its target's, and for the target less than the floor below),
so no constant suits them all. Until a few prefills were timed, `DEFAULT_OVERHEAD_TOKENS` stands in.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

DEFAULT_OVERHEAD_TOKENS = 64.0  # until measured: the demo target's best on the 2-core CPU
# A fit's ratio is clipped to this range. Its floor: where a forward of more tokens costs more per token
# (the 2-core CPU's caches), the straight line's intercept falls to about nothing; the demo target's fit
# of 8 tokens split 16-row admissions into 27 forwards, which took 895 ms a round where 64 tokens' 13
# took 812 (`benchmarks/prefill_groups.py` on 8fce4c2).
_OVERHEAD_RANGE = (32.0, 4096.0)
_MIN_PREFILLS = 4  # prefills timed before the fit replaces the default


class PrefillCost:
    """A model's prefill time as `overhead + per_token * padded_tokens`, fitted over its timed prefills."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._sums = np.zeros(5)  # count, sum of tokens, of seconds, of tokens^2, of tokens * seconds
        # on a GPU: CUDA events of prefills not yet read, resolved once done (no host sync)
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def timing(self, padded_tokens: int) -> Iterator[None]:
        """Time the prefill run inside the block, which computes `padded_tokens` tokens."""
        if not self.cuda:
            started = time.perf_counter()
            yield
            self.record(padded_tokens, time.perf_counter() - started)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._pending.append((padded_tokens, start, end))

    def record(self, tokens: int, seconds: float) -> None:
        """One prefill of `tokens` padded tokens took `seconds`."""
        self._sums += (1.0, tokens, seconds, float(tokens) ** 2, tokens * seconds)

    def overhead_tokens(self) -> float:
        """A forward's fixed cost in tokens' worth of prefill, from the fit (the default until it holds)."""
        fit = self._fit()
        return DEFAULT_OVERHEAD_TOKENS if fit is None else fit[0]

    def overhead_seconds(self) -> float:
        """A forward's fixed cost in seconds: `overhead_tokens` at the fitted cost of a token (0 until the
        fit holds), so the floor on the tokens holds here too."""
        fit = self._fit()
        return 0.0 if fit is None else fit[0] * fit[1]

    def _fit(self) -> tuple[float, float] | None:
        """(a forward's fixed cost in tokens, clipped to `_OVERHEAD_RANGE`; seconds per token) by least
        squares over the prefills timed, None while too few, all of one size, or fitting a token no cost."""
        unread = []
        for padded, start, end in self._pending:
            if end.query():
                self.record(padded, start.elapsed_time(end) / 1000.0)
            else:
                unread.append((padded, start, end))
        self._pending = unread
        count, tokens, seconds, tokens_squared, products = self._sums
        spread = count * tokens_squared - tokens**2
        if count < _MIN_PREFILLS or spread <= 0:
            return None
        per_token = (count * products - tokens * seconds) / spread
        if per_token <= 0:
            return None
        overhead = (seconds - per_token * tokens) / count
        return float(np.clip(overhead / per_token, *_OVERHEAD_RANGE)), float(per_token)


def length_groups(lengths: np.ndarray, overhead_tokens: float) -> list[np.ndarray]:
    """Positions of `lengths` [n] (> 0) in groups, shortest rows first, that make
    sum(overhead_tokens + rows * longest length) least over the groups."""
    order = np.argsort(lengths, kind="stable")  # [n]
    sorted_lengths = lengths[order].astype(np.float64)  # [n]
    count = len(order)
    least = np.zeros(count + 1)  # [n + 1] the cheapest cost of the first i sorted rows
    cut = np.zeros(count + 1, np.int64)  # [n + 1] where the last group of that cheapest split starts
    for end in range(1, count + 1):
        starts = np.arange(end)  # [end]
        costs = least[:end] + overhead_tokens + (end - starts) * sorted_lengths[end - 1]  # [end]
        cut[end] = int(costs.argmin())  # the first of equal costs: the fewer forwards
        least[end] = costs[cut[end]]
    groups: list[np.ndarray] = []
    end = count
    while end:
        groups.append(order[cut[end] : end])
        end = int(cut[end])
    return groups[::-1]
