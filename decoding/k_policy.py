"""How many draft tokens to propose this step, from measured step times and acceptance.

Speculation pays only while verification is cheap: on a GPU at small batch the target's forward
pass costs about the same for k + 1 tokens as for one, but once the target is compute-bound (on a
CPU already at small batches) verifying k + 1 tokens costs up to k + 1 times more. So every step
picks the k in [0, K] that maximises expected tokens per second (goodput, as in SmartSpec, Liu et
al. 2024):

    goodput(k) = E[tokens per row](k) / (overhead + t_draft(k) + t_target(k + 1))
    E[tokens per row](k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j

alpha_j is the measured probability that draft position j is accepted given that position j - 1
was, shrunk towards the acceptance pooled over all positions, so a position the policy has rarely
reached (because it chose a small k) is estimated from the others instead of from a fixed prior:
without that, an early run of small k would keep the deep positions unmeasured and k small for good.

Times are medians of the last few steps of each kind, per batch size (rows): a step slowed by a
garbage collection or a neighbouring process must not move the choice for dozens of steps. A step's
time includes booking its drafts and acceptance, host work that speculating alone pays.
Unmeasured target widths are interpolated between measured ones; a row count not measured at some
width borrows the shape of the nearest row count's curve (what width w costs relative to a width it
measured), so a batch that shrinks row by row at the end of a job needs no new warm-up steps, and the
steps it does take measure its own times. A step's drafting is timed by the number of draft forwards
it ran and interpolated between the counts measured, as the target's time is between widths, not
priced at that many times one forward: its first forward, which catches up the tokens just verified
after the target's forward, costs more than the ones after it (the demo draft model at batch 1 on the
2-core CPU, eager: 1.13 ms for a step of one forward, 3.91 ms for four). Priced per forward, the
one-forward probes of a resting policy made four forwards look dearer than they were, and it rested
where k = 4 paid.
Drafting is timed only on steps where the draft model ran (a looked-up proposal costs no forward; its
host time is part of the step's overhead), and a step runs as many forwards as its deepest draft-model
row takes, which may be fewer than its k where the hybrid's looked-up rows verify further
(decoding/model_free.py).

Every `probe_interval` steps a neighbouring k is tried, and every fourth probe the full K where its
estimate is not far below the best k's (`_FULL_PROBE_REACH`), so estimates never go stale; while probes
leave the choice where it was, the interval doubles (up to `_MAX_PROBE_BACKOFF` times), so a batch
where speculation does not pay stops paying for the reminder; but not before the draft model's
acceptance is measured on a few draft tokens (`_SETTLED_DRAFT_TOKENS`), and until then every probe
goes to the full K. Before any of that, a draft model's first steps (`_FIRST_FULL_STEPS`) all propose
the full K where it could pay at all (`_HOPEFUL_ACCEPTANCE`), so that no choice rests on the prior and
one early step.
Between a choice of k = 0 and the next probe the policy rests: the engine decodes plainly without
asking the proposer for offers (`wants_offers`), so prompt lookups and suffix-index walks, a few per
cent of a compute-bound batch's step, are not paid where they are not used; where they cost next to
nothing (a row or a few), it does not rest, and a match that comes up is taken when it comes up. For the same reason the
offers' measured time is charged to speculating only: choosing k = 0 stops paying it.

Rows need not offer the same number of draft tokens: a model-free proposer offers, per row, only what
its match supports (none without a match). The verify pass is as wide as the widest row, so k then
maximises the batch's goodput, sum over rows of E[tokens of row r](min(k, offer_r)) / step time(k),
with each row's acceptance measured separately for the proposer it drew from (the draft model,
prompt lookup, the suffix index): k = 0 wherever a few rows' matches do not pay for widening every row.
Where each row may take either of two proposals (the hybrid: the draft model's or a looked-up one),
`best_mix` weighs every verify width k and draft depth d <= k at once, each row taking what expects
more at that (k, d), priced as a step of width k + 1 that runs d draft forwards.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

_T = TypeVar("_T")

_WINDOW = 15  # steps a timing median covers
_YIELD_WINDOW = 32  # steps that looked up, whose mean yield decides whether a hybrid looks up
_MIN_YIELD_SAMPLES = 8  # ... once at least this many have
_ACCEPT_DECAY = 0.995  # acceptance counts fade so the estimate follows the prompt mix
_SHRINK = 4.0  # pseudo-observations of the pooled acceptance added to every position
# Acceptance before any is measured. A looked-up proposal starts optimistic: a span that recurred is
# usually what comes next (prompt lookup on the grounded workload: 0.98), and the hybrid must try it to
# measure it at all; a draft model's prior is neutral. Two pseudo-observations: data overrides either.
_DRAFT_MODEL_PRIOR, _LOOKED_UP_PRIOR = 0.5, 0.9
_MAX_PROBE_BACKOFF = 8  # the probe interval grows to at most this many times probe_interval
# Speculate only where the estimate promises at least this much over a plain step: on a compute-bound
# batch a narrow verify pays a few per cent at best, inside the error of the estimates (one engine's
# median step times differ from the next one's by a few per cent on the 2-core CPU)
_MIN_GAIN = 1.05
# A probe goes to the full K only where the estimate there is at least this share of the best k's: the
# full-K probe keeps the deepest positions' acceptance and the widest verify's time fresh, but on a
# compute-bound batch that rests (a 16-row batch verifying 9 tokens a row costs about 3 plain steps on
# the 2-core CPU) it re-measures a choice that stale estimates could not make win. An unmeasured width
# is estimated at the widest measured one's time, optimistically, so it is still probed.
_FULL_PROBE_REACH = 0.75
# Until the draft model's acceptance rests on this many draft tokens, every probe goes to the full K and
# the probes do not back off: from its neutral prior, one early rejection made speculation look as if
# it could not pay, and probes of one token, spaced ever wider, took most of a 1,000-step job (16
# prompts at batch 1) to learn otherwise. A probe of K tokens at batch 1 costs about two plain steps.
_SETTLED_DRAFT_TOKENS = 16
# A draft model's first steps all propose the full K, before any estimate decides: with probes alone
# (every `probe_interval` steps) a short job never learnt what its first step hid (the real pair at
# batch 1, 48-token requests: a first step that kept none of its drafts, then rests, mean k 0.30 at
# acceptance 0.76, where k = 3 fixed paid 1.61x). They cost at most about two plain steps each at batch 1.
_FIRST_FULL_STEPS = 4
# ... where they could pay at all: at this acceptance, a draft model that is nearly always right
_HOPEFUL_ACCEPTANCE = 0.9
# A resting policy still asks for offers where they cost less than this share of a plain step: resting
# saves only their time, and where that is next to nothing it lost the matches that came up between
# probes (SmolLM2 at batch 1 on the 2-core CPU: a prompt lookup or suffix walk 0.1-0.5 ms, a plain step
# 60-130 ms; the suffix contender rested through half of extract's steps)
_NEGLIGIBLE_OFFERS = 0.01
# A hybrid's offers add its plan (`best_mix`) to its lookups, about 0.5 ms a step at batch 1: on an
# idle 2-core CPU, whose plain SmolLM2 step is about 50 ms, over that line, so it rested where its
# lookups alone would not have, and missed their matches (code-edit: 1.50x against the suffix index's
# 2.63x). Its lookups' own time (`observe_lookups`) is held to the line instead: the plan is the price
# of taking the matches the lookups find.


class _Timing:
    """Median seconds of the last `_WINDOW` observations, the first one dropped once a second comes: the
    first forward of a shape (a width, a row count) builds its kernels (oneDNN's primitives, the
    allocator's blocks), and a median of one or two samples is that slow first one. Kept, it priced
    each width by its first forward, the widths a cold policy tried once looked dearer than a plain
    step, and it rested (the real pair at batch 1 on the 2-core CPU: mean k 0.30 at acceptance 0.76,
    0.92x target-only, where k = 3 fixed gave 1.61x)."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=_WINDOW)
        self.value: float | None = None
        self._first_kept = True  # the first sample is still in `samples`

    def add(self, seconds: float) -> None:
        if self._first_kept and self.samples:
            self.samples.clear()
            self._first_kept = False
        self.samples.append(seconds)
        self.value = statistics.median(self.samples)


class _Yield:
    """The mean of the last `_YIELD_WINDOW` ratios: a mean, not a median, since a lookup pays on the few
    steps where it matches and costs a little on all the others."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=_YIELD_WINDOW)

    def add(self, ratio: float) -> None:
        self.samples.append(ratio)

    @property
    def value(self) -> float:
        return statistics.fmean(self.samples)


class _Acceptance:
    """Per-position acceptance of one proposer, (decayed) counts."""

    def __init__(self, positions: int, prior: float) -> None:
        self.prior = prior
        self.reached = np.zeros(positions)  # [K] (decayed) rows whose draft got to position j
        self.accepted = np.zeros(positions)  # [K] (decayed) rows whose draft token j was accepted

    def fade(self) -> None:
        self.reached *= _ACCEPT_DECAY
        self.accepted *= _ACCEPT_DECAY

    def observe(self, num_accepted: np.ndarray, num_draft: np.ndarray) -> None:
        k = int(num_draft.max()) if num_draft.size else 0
        if k == 0:
            return
        positions = np.arange(k)
        offered = num_draft[:, None] > positions  # [rows, k]
        reached = ((num_accepted[:, None] >= positions) & offered).sum(axis=0)  # rows that got to position j
        accepted = (num_accepted[:, None] > positions).sum(axis=0)
        self.reached[:k] += reached
        self.accepted[:k] += accepted

    def measured(self) -> float:
        """The (decayed) draft tokens its acceptance rests on."""
        return float(self.reached.sum())

    def curve(self) -> np.ndarray:
        """[K] alpha_j, each shrunk towards the pooled acceptance (itself starting from `prior`)."""
        pooled = (self.accepted.sum() + 2.0 * self.prior) / (self.reached.sum() + 2.0)
        return (self.accepted + _SHRINK * pooled) / (self.reached + _SHRINK)


@dataclass(frozen=True)
class Mix:
    """A step's plan of draft-model and looked-up proposals (`SpeculationPolicy.best_mix`)."""

    k: int  # the most draft tokens a row verifies (0: speculation does not pay)
    depth: int  # forwards the draft model runs (its rows take at most this many tokens)
    takes_lookup: np.ndarray  # [n] bool, the rows that take their looked-up proposal
    rate: float  # its expected tokens per second (0 while not all of its costs are measured)
    seconds: float  # its estimated step time (0 while not measured)
    draft_alone_rate: float  # the rate of the best plan in which no row takes its lookup (0: not measured)


class SpeculationPolicy:
    def __init__(self, max_k: int, *, fixed: bool, probe_interval: int = 16):
        self.max_k = max_k
        self.fixed = fixed
        self.probe_interval = probe_interval
        self.steps = 0
        # rows -> draft forwards a step ran -> that step's drafting
        self.t_draft: dict[int, dict[int, _Timing]] = defaultdict(lambda: defaultdict(_Timing))
        self.t_target: dict[int, dict[int, _Timing]] = defaultdict(lambda: defaultdict(_Timing))  # rows -> width
        # rows -> the rest of a step (offers, acceptance, bookkeeping), plain and speculative apart: a
        # speculative step's host work is a few per cent of a compute-bound batch's step, as much as the
        # margin by which a narrow verify pays there
        self.t_overhead: dict[bool, dict[int, _Timing]] = {False: defaultdict(_Timing), True: defaultdict(_Timing)}
        self.t_offer: dict[int, _Timing] = defaultdict(_Timing)  # rows -> the proposer's offers
        # rows -> what a hybrid's lookups made of a step, net of their own time, over the draft model alone
        self.lookup_yield: dict[int, _Yield] = defaultdict(_Yield)
        self.t_lookup: dict[int, _Timing] = defaultdict(_Timing)  # rows -> a hybrid's lookups alone
        self._positions = max(max_k, 1)
        # proposer (decoding.stats.PROPOSERS index) -> its acceptance; the draft model's is 0
        self._acceptance: dict[int, _Acceptance] = {}
        self._next_probe = probe_interval
        self._probe_gap = probe_interval
        self._probes = 0
        self._draft_model_steps = 0  # steps whose proposals the draft model made, some of them at least
        self._best_at_last_probe: int | None = None
        self._resting_at: int | None = None  # the row count whose last choice was k = 0, until a probe
        # what the hybrid and `choose` ask several times a step, kept until the next observation
        self._expected_tokens: dict[int, np.ndarray] = {}  # source -> expected_tokens_by_length
        self._step_times: dict[tuple[int, int], np.ndarray] = {}  # (rows, top) -> step_time_table

    # -- observations -------------------------------------------------------------------------------
    def observe_step(
        self,
        rows: int,
        k: int,
        t_draft: float,
        t_target: float,
        t_total: float,
        *,
        t_offer: float | None = None,
        draft_forwards: int | None = None,
    ) -> None:
        """One step's times: `t_draft` of proposing k tokens (by `draft_forwards` forwards of the draft
        model, None: k; 0: all looked up, counted as overhead), `t_target` of verifying k + 1 per row,
        `t_offer` of the proposer's offers (None: the step made none)."""
        self._step_times.clear()
        forwards = k if draft_forwards is None else min(draft_forwards, k)
        drafted = forwards > 0
        if drafted:
            self.t_draft[rows][forwards].add(t_draft)
        self.t_target[rows][k + 1].add(t_target)
        if t_offer is not None:
            self.t_offer[rows].add(t_offer)
        rest = t_total - t_target - (t_draft if drafted else 0.0) - (t_offer or 0.0)
        self.t_overhead[k > 0][rows].add(max(rest, 0.0))

    def observe_acceptance(
        self, num_accepted: np.ndarray, num_draft: np.ndarray, sources: np.ndarray | None = None
    ) -> None:
        """num_accepted, num_draft: [rows] draft tokens each row accepted and was offered this step;
        sources: [rows] the proposer each row drew from (None: all the draft model).

        Every proposer's counts fade each speculative step, the unused ones' too: a proposer that lost
        a few early proposals and was then never chosen drifts back to its prior and is tried again,
        instead of being locked out by a handful of observations for the rest of the job."""
        self._expected_tokens.clear()
        for curve in self._acceptance.values():
            curve.fade()
        drafted = num_draft > 0
        if drafted.any() and (sources is None or (sources[drafted] == 0).any()):
            self._draft_model_steps += 1
        if sources is None:
            self._curve_of(0).observe(num_accepted, num_draft)
            return
        for source in np.unique(sources[num_draft > 0]):
            mine = sources == source
            self._curve_of(int(source)).observe(num_accepted[mine], num_draft[mine])

    def _curve_of(self, source: int) -> _Acceptance:
        if source not in self._acceptance:
            prior = _DRAFT_MODEL_PRIOR if source == 0 else _LOOKED_UP_PRIOR
            self._acceptance[source] = _Acceptance(self._positions, prior)
        return self._acceptance[source]

    # -- decision -----------------------------------------------------------------------------------
    def acceptance(self, source: int = 0) -> np.ndarray:
        """[K] alpha_j of proposer `source`, shrunk towards its pooled acceptance (before any: its prior)."""
        return self._curve_of(source).curve()

    def expected_tokens_by_length(self, source: int = 0) -> np.ndarray:
        """[K + 1] expected tokens a row yields from k = 0..K draft tokens of proposer `source`."""
        expected = self._expected_tokens.get(source)
        if expected is None:
            expected = 1.0 + np.concatenate([[0.0], np.cumsum(np.cumprod(self.acceptance(source)))])
            expected.flags.writeable = False
            self._expected_tokens[source] = expected
        return expected

    def step_times(self, rows: int, top: int, *, draft_depth: int | None = None) -> np.ndarray:
        """[top + 1] estimated seconds of a step of `rows` rows verifying k + 1 tokens each, k = 0..top,
        whose draft model runs min(k, `draft_depth`) forwards (None: k; 0: no draft model): inf where
        not measured yet."""
        return self.step_time_table(rows, top)[top if draft_depth is None else min(draft_depth, top)]

    def step_time_table(self, rows: int, top: int) -> np.ndarray:
        """[depth, k] `step_times` for every draft depth 0..top. Kept until the next step is observed."""
        table = self._step_times.get((rows, top))
        if table is None:
            table = self._step_times[(rows, top)] = self._step_time_table(rows, top)
            table.flags.writeable = False
        return table

    def _step_time_table(self, rows: int, top: int) -> np.ndarray:
        widths = np.arange(1, top + 2)
        target = self._target_times(rows, widths)
        if target is None:
            return np.full((top + 1, top + 1), np.inf)
        overheads = [_value(_nearest(self.t_overhead[speculative], rows)) for speculative in (False, True)]
        plain = overheads[0] or 0.0
        speculative = (overheads[1] if overheads[1] is not None else plain) + (
            _value(_nearest(self.t_offer, rows)) or 0.0
        )
        without_draft = np.where(widths > 1, speculative, plain) + target  # [k]
        forwards = np.minimum(widths[None, :] - 1, np.arange(top + 1)[:, None])  # [depth, k]
        drafting = _nearest(self._measured_drafts(), rows)
        if drafting is None:  # the draft model not timed yet: only plans without it are priced
            return np.where(forwards > 0, np.inf, without_draft[None, :])
        return without_draft[None, :] + _drafting_seconds(drafting, forwards)

    def _target_times(self, rows: int, widths: np.ndarray) -> np.ndarray | None:
        own = _measured(self.t_target.get(rows, {}))
        if own and min(own) <= widths[0] and widths[-1] <= max(own):
            return _interpolate(own, widths)  # the usual case: no other row count's curve needed
        curves = {r: m for r, m in ((r, _measured(t)) for r, t in self.t_target.items()) if len(m) >= 2}
        shape = _nearest(curves, rows)
        if shape is None:
            return _interpolate(own, widths) if own else None
        if not own:
            return _interpolate(shape, widths)
        measured = np.array(sorted(own))
        # outside its own measured widths, a row count scales its nearest measurement by the shape
        anchors = measured[np.abs(measured[None, :] - widths[:, None]).argmin(axis=1)]  # [widths]
        borrowed = np.array([own[a] for a in anchors]) * _interpolate(shape, widths) / _interpolate(shape, anchors)
        inside = (widths >= measured[0]) & (widths <= measured[-1])
        return np.where(inside, _interpolate(own, widths), borrowed)

    def _measured_drafts(self) -> dict[int, dict[int, float]]:
        """rows -> draft forwards -> a step's drafting seconds, where measured."""
        measured = ((rows, _measured(by_forwards)) for rows, by_forwards in self.t_draft.items())
        return {rows: points for rows, points in measured if points}

    def wants_offers(self, rows: int) -> bool:
        """Whether the next step of a batch of `rows` should ask the proposer for offers and `choose`;
        False while resting (the last choice at `rows` rows was k = 0 and no probe is due): the step is
        then plain, and `rest` counts it. Never resting where the offers' time (a hybrid's: its lookups')
        is negligible (`_NEGLIGIBLE_OFFERS`)."""
        if self.fixed or self._resting_at != rows or self.steps + 1 >= self._next_probe:
            return True
        lookups = _value(self.t_lookup.get(rows))  # a hybrid's; None for any other proposer
        offers = lookups if lookups is not None else _value(self.t_offer.get(rows))
        plain = _value(self.t_target.get(rows, {}).get(1))
        return offers is not None and plain is not None and offers < _NEGLIGIBLE_OFFERS * plain

    def rest(self) -> None:
        self.steps += 1

    def choose(
        self,
        rows: int,
        limit: int,
        offers: np.ndarray | None = None,
        sources: np.ndarray | None = None,
        tokens_left: np.ndarray | None = None,
    ) -> int:
        """The k for the next step of a batch of `rows`; `limit` caps it (context, tokens left). `offers`:
        [live] draft tokens each live row could take (None: `limit` each), from proposer `sources`
        [live] (None: all the draft model). `tokens_left`: [live] tokens each live row still wants, given
        where no request waits for a row (the batch drains): k then maximises the batch's tokens over the
        time it is expected to take to end (`rates`)."""
        self.steps += 1
        top = min(self.max_k, limit)
        if self.fixed or top <= 0:
            return max(top, 0)
        # Warm-up: measure the two ends first, so every k in between has an interpolated cost (later
        # row counts borrow the curve's shape); and the draft model's forward once it is to run.
        if not any(len(_measured(widths)) >= 2 for widths in self.t_target.values()):
            return 0 if top + 1 in _measured(self.t_target.get(rows, {})) else top
        depth = _draft_depth(offers, sources)
        if depth != 0 and not self._measured_drafts():  # the draft model runs
            return top
        first = top if depth is None else min(depth, top)  # the draft model's full depth, not a lookup's
        if depth != 0 and self._draft_model_steps < _FIRST_FULL_STEPS and self._full_k_could_pay(rows, first, depth):
            return first
        rates = self.rates(rows, top, offers, sources, tokens_left)
        best = _best_k(rates)
        self._resting_at = rows if best == 0 else None
        if self.steps < self._next_probe:
            return best
        self._probes += 1
        unsettled = _draft_depth(offers, sources) != 0 and self._curve_of(0).measured() < _SETTLED_DRAFT_TOKENS
        unchanged = best == self._best_at_last_probe and not unsettled
        self._best_at_last_probe = best
        self._probe_gap = (
            min(self._probe_gap * 2, self.probe_interval * _MAX_PROBE_BACKOFF) if unchanged else self.probe_interval
        )
        self._next_probe = self.steps + self._probe_gap
        if unsettled or (self._probes % 4 == 0 and rates[top] >= _FULL_PROBE_REACH * rates[best]):
            return top
        # Alternate probing above and below the current best.
        return min(best + 1, top) if self._probes % 2 == 0 or best == 0 else best - 1

    def _full_k_could_pay(self, rows: int, top: int, depth: int | None) -> bool:
        """Whether `top` draft tokens a row would pay at the step times measured if the draft model were
        nearly always right (`_HOPEFUL_ACCEPTANCE`): where even then they would not (a compute-bound
        batch, whose verify costs its width), a cold policy does not try them first."""
        times = self.step_times(rows, top, draft_depth=depth)  # [top + 1]
        if not np.isfinite(times[[0, top]]).all():  # not measured at these rows yet: no evidence it could
            return False
        hopeful = 1.0 + float(np.sum(_HOPEFUL_ACCEPTANCE ** np.arange(1, top + 1)))
        return bool(hopeful / times[top] >= _MIN_GAIN / times[0])

    def best(
        self, rows: int, top: int, offers: np.ndarray | None = None, sources: np.ndarray | None = None
    ) -> tuple[int, float]:
        """The k in [0, top] of the most expected tokens per second, and that rate (0 where no step time
        is known yet); no side effects."""
        rates = self.rates(rows, top, offers, sources)
        best = _best_k(rates)
        return best, float(rates[best])

    def rates(
        self,
        rows: int,
        top: int,
        offers: np.ndarray | None = None,
        sources: np.ndarray | None = None,
        tokens_left: np.ndarray | None = None,
    ) -> np.ndarray:
        """[top + 1] expected tokens per second at k = 0..top (0 where a step time is not known yet).

        With `tokens_left` [live] (a draining batch: no request waits for a row), the batch's tokens
        over the time it is expected to take to end if this step verifies k + 1 tokens and every later
        step is plain: the step's time plus a plain step's for every token its furthest row then still
        wants. A draining batch ends with its slowest row, and a row that ends early frees a row no
        request takes, so its tokens shorten nothing while every wider step lengthens the slowest row's.
        SmolLM2 at 16 rows on one thread, 16 code-edit prompts of 32 tokens: k = 5 steps (3.6 plain
        steps' time) paid about 1.25x a plain step's tokens per second, but the rows they ended early left
        the rows without matches a tail of 15 steps at 1-7 rows, 1.7 s of the pass's 5.5 s of decoding
        against target-only's 5.1 s. At k = 0 the rate is a plain step's, as without `tokens_left`."""
        times = self.step_times(rows, top, draft_depth=_draft_depth(offers, sources))  # [top + 1]
        if tokens_left is None:
            return self._expected_batch_tokens(top, offers, sources) / times
        left = np.maximum(tokens_left, 1).astype(float)  # [live]
        behind = np.max(left[:, None] - self._expected_row_tokens(top, offers, sources, left.size), axis=0)
        return left.size * left.max() / (times + times[0] * np.maximum(behind, 0.0))

    def _expected_batch_tokens(self, top: int, offers: np.ndarray | None, sources: np.ndarray | None) -> np.ndarray:
        """[top + 1] expected tokens the step yields at k = 0..top (per row when every row offers `top`)."""
        if offers is None:
            return self.expected_tokens_by_length()[: top + 1]
        return self._expected_row_tokens(top, offers, sources, offers.size).sum(axis=0)

    def _expected_row_tokens(
        self, top: int, offers: np.ndarray | None, sources: np.ndarray | None, live: int
    ) -> np.ndarray:
        """[live, top + 1] expected tokens each live row yields at k = 0..top."""
        if offers is None:
            return np.broadcast_to(self.expected_tokens_by_length()[: top + 1], (live, top + 1))
        sources = np.zeros_like(offers) if sources is None else sources
        by_row = np.ones((offers.size, top + 1))
        for source in np.unique(sources):
            mine = sources == source
            by_row[mine] += _accepted_by_row(self.expected_tokens_by_length(int(source)), offers[mine], top)
        return by_row

    def best_mix(
        self, rows: int, draft_offers: np.ndarray, lookup_offers: np.ndarray, lookup_sources: np.ndarray
    ) -> Mix:
        """The plan of the most expected tokens per second for a step where every live row may take the
        draft model's proposal (up to `draft_offers` [n] tokens) or its looked-up one (`lookup_offers` [n]
        tokens from `lookup_sources` [n]): the verify pass's k, the draft model's depth (its forwards),
        and the rows that take their lookup. Every (k, depth) is weighed with each row taking whichever
        proposal expects more at that k and depth: a long lookup is worth its row only at the width the
        whole batch then verifies, and the draft model's forwards only for the rows that take them. The
        draft model alone (every row drafted) and the lookups alone (depth 0) are two of the plans, so
        the mix is never estimated below either. Before the draft model's forward and the target are
        timed, each row takes the proposal that expects more at its full length, and the step's choice
        (`choose`) measures what is missing."""
        sources = np.unique(lookup_sources)
        curves = np.zeros((0, self._positions + 1))  # [proposers, K + 1]
        if sources.size:
            curves = np.stack([self.expected_tokens_by_length(int(source)) for source in sources])
        by_lookup = curves[np.searchsorted(sources, lookup_sources)]  # [n, K + 1], no loop over rows
        return self._mix(rows, draft_offers, lookup_offers, by_lookup)

    def could_take_a_lookup(
        self, rows: int, draft_offers: np.ndarray, longest: np.ndarray, candidates: Sequence[int]
    ) -> bool:
        """Whether `best_mix` could take any row's lookup, judged before any lookup from the best one could
        be: as long as the row may take (`longest` [n] tokens), at the acceptance of whichever of
        `candidates` expects the most at that length. Every real lookup expects at most that at every k
        and depth, so where even these are not taken, no real lookup would be (up to exact ties)."""
        best = np.max([self.expected_tokens_by_length(source) for source in candidates], axis=0)  # [K + 1]
        optimistic = self._mix(rows, draft_offers, longest, np.broadcast_to(best, (draft_offers.size, best.size)))
        return bool(optimistic.takes_lookup.any())

    def observe_lookups(self, rows: int, seconds: float, mix: Mix) -> None:
        """A hybrid's step looked rows up in `seconds` (prompt lookups, suffix-index walks) and planned
        `mix`: keep the ratio of its expected tokens per second, the lookups' time added to its step, to
        the draft model's alone; and the lookups' own time, which decides whether a resting policy still
        asks for offers (`wants_offers`)."""
        self.t_lookup[rows].add(seconds)
        if mix.rate > 0 and mix.draft_alone_rate > 0:
            net = mix.rate * mix.seconds / (mix.seconds + seconds)
            self.lookup_yield[rows].add(net / mix.draft_alone_rate)

    def lookups_pay(self, rows: int) -> bool:
        """Whether a hybrid's lookups have yielded more than they cost at about `rows` rows (on average over
        the last steps that looked up; True until `_MIN_YIELD_SAMPLES` of them: a job's first lookups
        find little, its suffix index empty)."""
        measured = _nearest(self.lookup_yield, rows)
        return measured is None or len(measured.samples) < _MIN_YIELD_SAMPLES or measured.value > 1.0

    def _mix(self, rows: int, draft_offers: np.ndarray, lookup_offers: np.ndarray, by_lookup: np.ndarray) -> Mix:
        """`best_mix` with each row's expected tokens by lookup length given: by_lookup [n, K + 1]."""
        n = draft_offers.size
        top = int(max(draft_offers.max(initial=0), lookup_offers.max(initial=0)))
        by_draft = self.expected_tokens_by_length(0)  # [K + 1]
        times = self.step_time_table(rows, top)  # [depth, k]
        if not np.isfinite(times[top, top]):
            takes_lookup = by_lookup[np.arange(n), lookup_offers] > by_draft[draft_offers]
            return Mix(top, top, takes_lookup, 0.0, 0.0, 0.0)
        ks = np.arange(top + 1)
        lookup_gain = by_lookup[np.arange(n)[:, None], np.minimum(lookup_offers[:, None], ks)]  # [n, k]
        depths = np.minimum(ks[:, None], ks[None, :])  # [depth, k]: the forwards the draft model runs
        draft_gain = by_draft[np.minimum(draft_offers[:, None, None], depths)]  # [n, depth, k]
        draft_alone = _best_rate(draft_gain.sum(axis=0) / times)
        rates = np.maximum(draft_gain, lookup_gain[:, None, :]).sum(axis=0) / times  # [depth, k]
        depth, k = np.unravel_index(int(np.argmax(rates)), rates.shape)
        if rates[depth, k] < _MIN_GAIN * rates[0, 0]:  # plain; rows keep what expects more, for a probe
            takes_lookup = lookup_gain[:, top] > draft_gain[:, top, top]
            return Mix(0, 0, takes_lookup, float(rates[0, 0]), float(times[0, 0]), draft_alone)
        takes_lookup = lookup_gain[:, k] > draft_gain[:, depth, k]
        return Mix(
            int(k), int(min(depth, k)), takes_lookup, float(rates[depth, k]), float(times[depth, k]), draft_alone
        )


def _best_k(rates: np.ndarray) -> int:
    """The k of the most expected tokens per second, of `rates` [top + 1]; 0 unless it gains enough."""
    best = int(np.argmax(rates))
    return best if rates[best] >= _MIN_GAIN * rates[0] else 0


def _best_rate(rates: np.ndarray) -> float:
    """The rate `_mix` plans at, of plans' rates [depth, k]: the best, unless it gains too little over a
    plain step's."""
    best = float(rates.max())
    return best if best >= _MIN_GAIN * rates[0, 0] else float(rates[0, 0])


def _accepted_by_row(expected_by_length: np.ndarray, offers: np.ndarray, top: int) -> np.ndarray:
    """[n, top + 1] draft tokens each row offering `offers` [n] is expected to have accepted at k = 0..top."""
    gains = expected_by_length[: top + 1] - 1.0  # [top + 1] accepted of j drafted
    taken = np.minimum(np.minimum(offers, top)[:, None], np.arange(top + 1))  # [n, top + 1]
    return gains[taken]


def _draft_depth(offers: np.ndarray | None, sources: np.ndarray | None) -> int | None:
    """The most forwards the draft model runs in a step with these offers: its deepest row's offer
    (DRAFT_MODEL is proposer 0); None: as many as the step's k (every row drafts with it)."""
    if sources is None:
        return None
    if offers is None:
        return None if (sources == 0).any() else 0
    return int(offers[sources == 0].max(initial=0))


def _value(timing: _Timing | None) -> float | None:
    return None if timing is None else timing.value


def _nearest(table: Mapping[int, _T], rows: int) -> _T | None:
    if rows in table:
        return table[rows]
    if not table:
        return None
    return table[min(table, key=lambda r: abs(r - rows))]


def _measured(widths: Mapping[int, _Timing]) -> dict[int, float]:
    return {w: t.value for w, t in widths.items() if t.value is not None}


def _drafting_seconds(points: dict[int, float], forwards: np.ndarray) -> np.ndarray:
    """A step's drafting by its draft forwards (0: none), from the counts measured (`points`): piecewise
    linear between them, and beyond them along the nearest two's slope (one count measured: in
    proportion to it). The slope is never taken below 0: an underestimate is soon measured, an
    overestimate never is."""
    counts = sorted(points)
    times = np.array([points[c] for c in counts])
    if len(counts) == 1:
        low_slope = high_slope = times[0] / counts[0]
    else:
        low_slope = max((times[1] - times[0]) / (counts[1] - counts[0]), 0.0)
        high_slope = max((times[-1] - times[-2]) / (counts[-1] - counts[-2]), 0.0)
    seconds = np.interp(forwards, counts, times)
    seconds = np.where(forwards < counts[0], times[0] - (counts[0] - forwards) * low_slope, seconds)
    seconds = np.where(forwards > counts[-1], times[-1] + (forwards - counts[-1]) * high_slope, seconds)
    return np.where(forwards > 0, np.maximum(seconds, 0.0), 0.0)


def _interpolate(points: dict[int, float], widths: np.ndarray) -> np.ndarray:
    """Piecewise-linear in the target's width (tokens per row); flat outside the measured range."""
    measured = sorted(points)
    return np.interp(widths, measured, [points[w] for w in measured])
