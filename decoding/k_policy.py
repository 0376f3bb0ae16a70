"""How many draft tokens to propose this step, from measured step times and acceptance.

Speculation pays only while verification is cheap: on a GPU at small batch the target's forward
pass costs about the same for k + 1 tokens as for one, but once the target is compute-bound (on a
CPU already at small batches) verifying k + 1 tokens costs up to k + 1 times more. So every step
picks the k in [0, K] that maximises expected tokens per second (goodput, as in SmartSpec, Liu et
al. 2024):

    goodput(k) = E[tokens per row](k) / (overhead + k * t_draft + t_target(k + 1))
    E[tokens per row](k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j

alpha_j is the measured probability that draft position j is accepted given that position j - 1
was, shrunk towards the acceptance pooled over all positions, so a position the policy has rarely
reached (because it chose a small k) is estimated from the others instead of from a fixed prior:
without that, an early run of small k would keep the deep positions unmeasured and k small for good.

Times are medians of the last few steps of each kind, per batch size (rows): a step slowed by a
garbage collection or a neighbouring process must not move the choice for dozens of steps.
Unmeasured target widths are interpolated between measured ones. Every `probe_interval` steps a
neighbouring k is tried, and every fourth probe the full K, so estimates never go stale.

Rows need not offer the same number of draft tokens: a model-free proposer offers, per row, only what
its match supports (none without a match). The verify pass is as wide as the widest row, so k then
maximises the batch's goodput, sum over rows of E[tokens of row r](min(k, offer_r)) / step time(k),
with each row's acceptance measured separately for the proposer it drew from (the draft model,
prompt lookup, the suffix index): k = 0 wherever a few rows' matches do not pay for widening every row.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict, deque
from collections.abc import Mapping
from typing import TypeVar

import numpy as np

_T = TypeVar("_T")

_WINDOW = 15  # steps a timing median covers
_ACCEPT_DECAY = 0.995  # acceptance counts fade so the estimate follows the prompt mix
_SHRINK = 4.0  # pseudo-observations of the pooled acceptance added to every position


class _Timing:
    """Median seconds of the last `_WINDOW` observations."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=_WINDOW)
        self.value: float | None = None

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.value = statistics.median(self.samples)


class _Acceptance:
    """Per-position acceptance of one proposer, (decayed) counts."""

    def __init__(self, positions: int) -> None:
        self.reached = np.zeros(positions)  # [K] (decayed) rows whose draft got to position j
        self.accepted = np.zeros(positions)  # [K] (decayed) rows whose draft token j was accepted

    def observe(self, num_accepted: np.ndarray, num_draft: np.ndarray) -> None:
        k = int(num_draft.max()) if num_draft.size else 0
        if k == 0:
            return
        positions = np.arange(k)
        offered = num_draft[:, None] > positions  # [rows, k]
        reached = ((num_accepted[:, None] >= positions) & offered).sum(axis=0)  # rows that got to position j
        accepted = (num_accepted[:, None] > positions).sum(axis=0)
        self.reached *= _ACCEPT_DECAY
        self.accepted *= _ACCEPT_DECAY
        self.reached[:k] += reached
        self.accepted[:k] += accepted

    def curve(self) -> np.ndarray:
        """[K] alpha_j, each shrunk towards the pooled acceptance (itself starting from a prior of 0.5)."""
        pooled = (self.accepted.sum() + 1.0) / (self.reached.sum() + 2.0)
        return (self.accepted + _SHRINK * pooled) / (self.reached + _SHRINK)


class SpeculationPolicy:
    def __init__(self, max_k: int, *, fixed: bool, probe_interval: int = 16):
        self.max_k = max_k
        self.fixed = fixed
        self.probe_interval = probe_interval
        self.steps = 0
        self.t_draft: dict[int, _Timing] = defaultdict(_Timing)  # rows -> one draft forward
        self.t_target: dict[int, dict[int, _Timing]] = defaultdict(lambda: defaultdict(_Timing))  # rows -> width
        self.t_overhead: dict[int, _Timing] = defaultdict(_Timing)  # rows -> rest of a step
        self._positions = max(max_k, 1)
        # proposer (decoding.stats.PROPOSERS index) -> its acceptance; the draft model's is 0
        self._acceptance: dict[int, _Acceptance] = {}

    # -- observations -------------------------------------------------------------------------------
    def observe_step(self, rows: int, k: int, t_draft: float, t_target: float, t_total: float) -> None:
        if k:
            self.t_draft[rows].add(t_draft / k)
        self.t_target[rows][k + 1].add(t_target)
        self.t_overhead[rows].add(max(t_total - t_draft - t_target, 0.0))

    def observe_acceptance(
        self, num_accepted: np.ndarray, num_draft: np.ndarray, sources: np.ndarray | None = None
    ) -> None:
        """num_accepted, num_draft: [rows] draft tokens each row accepted and was offered this step;
        sources: [rows] the proposer each row drew from (None: all the draft model)."""
        if sources is None:
            self._curve_of(0).observe(num_accepted, num_draft)
            return
        for source in np.unique(sources[num_draft > 0]):
            mine = sources == source
            self._curve_of(int(source)).observe(num_accepted[mine], num_draft[mine])

    def _curve_of(self, source: int) -> _Acceptance:
        if source not in self._acceptance:
            self._acceptance[source] = _Acceptance(self._positions)
        return self._acceptance[source]

    # -- decision -----------------------------------------------------------------------------------
    def acceptance(self, source: int = 0) -> np.ndarray:
        """[K] alpha_j of proposer `source`, each shrunk towards its pooled acceptance (prior 0.5)."""
        return self._curve_of(source).curve()

    def expected_tokens(self, k: int, source: int = 0) -> float:
        return 1.0 + float(np.cumprod(self.acceptance(source)[:k]).sum()) if k else 1.0

    def step_time(self, rows: int, k: int) -> float | None:
        draft = _nearest(self.t_draft, rows)
        targets = _nearest(self.t_target, rows)
        if targets is None or (k and _value(draft) is None):
            return None
        measured = {w: t.value for w, t in targets.items() if t.value is not None}
        if not measured:
            return None
        return (
            (_value(_nearest(self.t_overhead, rows)) or 0.0)
            + k * (_value(draft) or 0.0)
            + _interpolate(measured, k + 1)
        )

    def choose(self, rows: int, limit: int, offers: np.ndarray | None = None, sources: np.ndarray | None = None) -> int:
        """The k for the next step of a batch of `rows`; `limit` caps it (context, tokens left). `offers`:
        [live] draft tokens each live row could take (None: `limit` each), from proposer `sources`
        [live] (None: all the draft model)."""
        self.steps += 1
        top = min(self.max_k, limit)
        if self.fixed or top <= 0:
            return max(top, 0)
        measured = self.t_target.get(rows, {})
        # Warm-up: measure the two ends first, so every k in between has an interpolated cost.
        for width in (top + 1, 1):
            if width not in measured or measured[width].value is None:
                return width - 1
        expected = self._expected_batch_tokens(top, offers, sources)  # [top + 1]
        seconds = np.array([self.step_time(rows, k) or np.inf for k in range(top + 1)])
        best = int(np.argmax(expected / seconds))
        if self.steps % self.probe_interval == 0:
            probe = self.steps // self.probe_interval
            if probe % 4 == 0:
                return top
            # Alternate probing above and below the current best.
            best = min(best + 1, top) if probe % 2 == 0 or best == 0 else best - 1
        return best

    def _expected_batch_tokens(self, top: int, offers: np.ndarray | None, sources: np.ndarray | None) -> np.ndarray:
        """[top + 1] expected tokens the step yields at k = 0..top (per row when every row offers `top`)."""
        if offers is None:
            return 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance()[:top]))])
        sources = np.zeros_like(offers) if sources is None else sources
        total = np.full(top + 1, float(offers.size))
        for source in np.unique(sources):
            # gains[j]: expected accepted tokens when a row takes j draft tokens
            gains = np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance(int(source))[:top]))])
            row_offers = np.minimum(offers[sources == source], top)  # [n]
            taken = np.minimum(row_offers[:, None], np.arange(top + 1))  # [n, top + 1]
            total += gains[taken].sum(axis=0)
        return total


def _value(timing: _Timing | None) -> float | None:
    return None if timing is None else timing.value


def _nearest(table: Mapping[int, _T], rows: int) -> _T | None:
    if rows in table:
        return table[rows]
    if not table:
        return None
    return table[min(table, key=lambda r: abs(r - rows))]


def _interpolate(points: dict[int, float], width: int) -> float:
    """Piecewise-linear in the target's width (tokens per row); flat outside the measured range."""
    widths = sorted(points)
    if width <= widths[0]:
        return points[widths[0]]
    if width >= widths[-1]:
        return points[widths[-1]]
    i = bisect.bisect_left(widths, width)
    lo, hi = widths[i - 1], widths[i]
    frac = (width - lo) / (hi - lo)
    return points[lo] * (1 - frac) + points[hi] * frac
