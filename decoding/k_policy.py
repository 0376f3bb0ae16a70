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


class SpeculationPolicy:
    def __init__(self, max_k: int, *, fixed: bool, probe_interval: int = 16):
        self.max_k = max_k
        self.fixed = fixed
        self.probe_interval = probe_interval
        self.steps = 0
        self.t_draft: dict[int, _Timing] = defaultdict(_Timing)  # rows -> one draft forward
        self.t_target: dict[int, dict[int, _Timing]] = defaultdict(lambda: defaultdict(_Timing))  # rows -> width
        self.t_overhead: dict[int, _Timing] = defaultdict(_Timing)  # rows -> rest of a step
        positions = max(max_k, 1)
        self.reached = np.zeros(positions)  # [K] (decayed) rows whose draft got to position j
        self.accepted = np.zeros(positions)  # [K] (decayed) rows whose draft token j was accepted

    # -- observations -------------------------------------------------------------------------------
    def observe_step(self, rows: int, k: int, t_draft: float, t_target: float, t_total: float) -> None:
        if k:
            self.t_draft[rows].add(t_draft / k)
        self.t_target[rows][k + 1].add(t_target)
        self.t_overhead[rows].add(max(t_total - t_draft - t_target, 0.0))

    def observe_acceptance(self, num_accepted: np.ndarray, num_draft: np.ndarray) -> None:
        """num_accepted, num_draft: [rows] draft tokens each row accepted and was offered this step."""
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

    # -- decision -----------------------------------------------------------------------------------
    def acceptance(self) -> np.ndarray:
        """[K] alpha_j, each shrunk towards the pooled acceptance (itself starting from a prior of 0.5)."""
        pooled = (self.accepted.sum() + 1.0) / (self.reached.sum() + 2.0)
        return (self.accepted + _SHRINK * pooled) / (self.reached + _SHRINK)

    def expected_tokens(self, k: int) -> float:
        return 1.0 + float(np.cumprod(self.acceptance()[:k]).sum()) if k else 1.0

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

    def choose(self, rows: int, limit: int) -> int:
        """The k for the next step of a batch of `rows`; `limit` caps it (context, tokens left)."""
        self.steps += 1
        top = min(self.max_k, limit)
        if self.fixed or top <= 0:
            return max(top, 0)
        measured = self.t_target.get(rows, {})
        # Warm-up: measure the two ends first, so every k in between has an interpolated cost.
        for width in (top + 1, 1):
            if width not in measured or measured[width].value is None:
                return width - 1
        expected = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance()[:top]))])  # [top + 1]
        seconds = np.array([self.step_time(rows, k) or np.inf for k in range(top + 1)])
        best = int(np.argmax(expected / seconds))
        if self.steps % self.probe_interval == 0:
            probe = self.steps // self.probe_interval
            if probe % 4 == 0:
                return top
            # Alternate probing above and below the current best.
            best = min(best + 1, top) if probe % 2 == 0 or best == 0 else best - 1
        return best


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
