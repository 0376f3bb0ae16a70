"""A step's plan: how many draft tokens each row proposes, and from which proposer.

The proposer first says what each row could offer (a model-free proposer offers only what its match
supports: decoding/proposer.py), then the policy (decoding/k_policy.py) picks k from those offers and
its measured step times, and each row drafts the smaller of its offer and k. While the policy rests,
the proposer is asked for nothing and the step is plain (k = 0), as every step is without a proposer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specq.decoding.batch import BatchState
from specq.decoding.k_policy import SpeculationPolicy
from specq.decoding.proposer import Proposer
from specq.decoding.stats import DRAFT_MODEL


@dataclass(frozen=True)
class DraftPlan:
    k: int  # the most draft tokens a row proposes this step; 0: a plain step
    num_draft: np.ndarray  # [rows] draft tokens each row proposes (0 for rows not live or without an offer)
    sources: np.ndarray  # [rows] the proposer each row's draft comes from (decoding.stats.PROPOSERS)
    offered: bool  # whether the proposer was asked for offers (not: no proposer, or the policy rests)

    @property
    def draft_forwards(self) -> int:
        """The draft model's forwards: as many as its deepest row takes (decoding/model_free.py)."""
        return int(self.num_draft[self.sources == DRAFT_MODEL].max(initial=0))


def plan_drafts(
    batch: BatchState,
    live: np.ndarray,
    proposer: Proposer | None,
    policy: SpeculationPolicy,
    max_context: int,
    *,
    draining: bool = False,
) -> DraftPlan:
    """The plan of the next step of `batch`, whose rows `live` decode; a resting policy is told it rested.
    `draining`: no request waits for a row, so the policy weighs the rows' tokens left (`choose`)."""
    if proposer is None or not policy.wants_offers(batch.rows):
        if proposer is not None:
            policy.rest()
        none = np.zeros(batch.rows, np.int64)  # [rows]
        return DraftPlan(0, none, none.copy(), offered=False)
    # A row takes at most one draft token fewer than it still wants, and none past the context.
    row_limits = np.minimum(batch.max_tokens_h - batch.generated_h - 1, max_context - batch.seq_h)  # [rows]
    offer = proposer.offer(batch, live, np.maximum(row_limits, 0))
    offers = offer.lengths[live]  # [live]
    top = int(offers.max())
    # no row has anything to offer (no match anywhere): a plain step, and no time measured for the policy
    tokens_left = row_limits[live] + 1 if draining else None  # [live]
    k = policy.choose(batch.rows, top, offers, offer.sources[live], tokens_left) if top > 0 else 0
    num_draft = np.zeros(batch.rows, np.int64)  # [rows]
    if k:
        num_draft[live] = np.minimum(offers, k)
        k = int(num_draft.max())
    return DraftPlan(k, num_draft, offer.sources, offered=True)
