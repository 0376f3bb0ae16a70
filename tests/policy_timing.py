"""Step times a test controls, for tests whose verdict rests on what the adaptive-k policy chooses.

The engine times every step with the machine's clock and feeds the policy those times
(`SpeculationPolicy.observe_step`). A test that seeds the policy with modelled times and then runs an
engine would otherwise mix its model with the machine's measurements, so its outcome would depend on how
fast and how busy the machine is. `modelled_step_times` swaps the measurements for a cost model at the
policy's door: the engine, its steps and its tokens are untouched; only the times the policy learns from
are the test's.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from specq.decoding.k_policy import SpeculationPolicy


def modelled_step_times(
    monkeypatch: pytest.MonkeyPatch,
    policy: SpeculationPolicy,
    t_target: Callable[[int, int], float],
    t_draft_forward: float = 0.0,
    t_offer: float = 0.0,
) -> None:
    """Make `policy` learn `t_target(rows, width)` seconds for verifying `width` tokens a row,
    `t_draft_forward` seconds a draft-model forward and `t_offer` the offers of a step that made them,
    whatever the machine measured; the host's bookkeeping costs nothing."""
    observe = policy.observe_step
    offers_cost = t_offer

    def modelled(rows, k, t_draft, t_target_measured, t_total, *, t_offer=None, draft_forwards=None):
        forwards = k if draft_forwards is None else min(draft_forwards, k)
        draft_s = t_draft_forward * forwards
        target_s = t_target(rows, k + 1)
        offer_s = None if t_offer is None else offers_cost  # None: the step made no offers
        total_s = draft_s + target_s + (offer_s or 0.0)
        observe(rows, k, draft_s, target_s, total_s, t_offer=offer_s, draft_forwards=draft_forwards)

    monkeypatch.setattr(policy, "observe_step", modelled)
