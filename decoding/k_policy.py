"""How many draft tokens to propose this step, from measured step times and acceptance.

Speculation pays only while verification is cheap: on a GPU at small batch the target's forward
pass costs about the same for k + 1 tokens as for one, but once the target is compute-bound (on a
CPU already at small batches) verifying k + 1 tokens costs up to k + 1 times more. So every step
picks the k in [0, K] that maximises expected tokens per second (goodput, as in SmartSpec, Liu et
al. 2024):

    goodput(k) = E[tokens per row](k) / (overhead + k * t_draft + t_target(k + 1))
    E[tokens per row](k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j

where alpha_j is the measured probability that draft position j is accepted given that position
j - 1 was, and the times are running means measured per batch size (rows). k = 0 is plain
decoding. Unmeasured target widths are interpolated between measured ones. Every
`probe_interval` steps a neighbouring k is tried, so estimates never go stale.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import numpy as np

_EMA = 0.2  # weight of the newest timing; steps are noisy, batch shapes drift
_ACCEPT_DECAY = 0.995  # acceptance counts fade so the estimate follows the prompt mix


class _Mean:
    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, seconds: float) -> None:
        self.value = seconds if self.value is None else (1 - _EMA) * self.value + _EMA * seconds


class SpeculationPolicy:
    def __init__(self, max_k: int, *, fixed: bool, probe_interval: int = 16):
        self.max_k = max_k
        self.fixed = fixed
        self.probe_interval = probe_interval
        self.steps = 0
        self.t_draft: dict[int, _Mean] = defaultdict(_Mean)  # rows -> one draft forward
        self.t_target: dict[int, dict[int, _Mean]] = defaultdict(lambda: defaultdict(_Mean))  # rows -> width
        self.t_overhead: dict[int, _Mean] = defaultdict(_Mean)  # rows -> rest of a step
        self.reached = np.full(max(max_k, 1), 2.0)  # prior: alpha_j = 0.5, worth two observations
        self.accepted = np.full(max(max_k, 1), 1.0)

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
        return self.accepted / self.reached  # [K] alpha_j

    def expected_tokens(self, k: int) -> float:
        return 1.0 + float(np.cumprod(self.acceptance()[:k]).sum()) if k else 1.0

    def step_time(self, rows: int, k: int) -> float | None:
        draft = _nearest(self.t_draft, rows)
        targets = _nearest(self.t_target, rows)
        if targets is None or (k and draft is None):
            return None
        target = _interpolate({w: m.value for w, m in targets.items() if m.value is not None}, k + 1)
        return _value(_nearest(self.t_overhead, rows)) + k * _value(draft) + target

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
        goodput = []
        for k in range(top + 1):
            seconds = self.step_time(rows, k)
            goodput.append(self.expected_tokens(k) / seconds if seconds else 0.0)
        best = int(np.argmax(goodput))
        if self.steps % self.probe_interval == 0:
            # Alternate probing above and below the current best.
            above = (self.steps // self.probe_interval) % 2 == 0
            best = min(best + 1, top) if above or best == 0 else best - 1
        return best


def _value(mean: _Mean | None) -> float:
    return mean.value if mean is not None and mean.value is not None else 0.0


def _nearest(table: dict, rows: int):
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
