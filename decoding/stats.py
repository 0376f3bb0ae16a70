"""Raw decoding counters, named as vLLM names them; rates are derived where they are read.

Terms (vLLM's rejection sampler):
- a *draft* is one sequence's proposal in one step (k >= 1 draft tokens);
- *accepted* tokens are draft tokens the target kept;
- the *recovered* token is sampled from the residual max(0, target - draft) at the first rejection;
- the *bonus* token is the extra target token when all k draft tokens were accepted;
- the *output* of a step for a sequence is its accepted tokens plus one recovered or bonus token.

acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts
(it counts the recovered or bonus token each draft also yields). What acceptance and a draft's cost
promise: `leviathan_bound`.

`by_proposer` splits drafts, draft tokens and accepted tokens by where each draft came from: the draft
model, prompt lookup (`ngram`) or the job's suffix index (`suffix`); see `PROPOSERS`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

# Where a row's draft came from; a proposer's `sources` hold these indices.
PROPOSERS = ("draft", "ngram", "suffix")
DRAFT_MODEL, NGRAM, SUFFIX = range(3)
PROPOSER_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


def leviathan_bound(alpha: float, cost_ratio: float, k: int) -> float:
    """Expected speedup of speculative decoding with k draft tokens (Leviathan et al. 2023, Theorem
    3.8): (1 - a^(k+1)) / ((1 - a)(k c + 1)), with its limit (k + 1) / (k c + 1) at a = 1.

    `alpha` is the paper's acceptance rate: the probability that a draft token is accepted given
    that the ones before it were, not vLLM's accepted / draft tokens; `cost_ratio` (c) is a draft
    forward's time over a target forward's."""
    if alpha >= 1.0:
        return (k + 1) / (k * cost_ratio + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * cost_ratio + 1))


def empty_by_proposer() -> dict[str, dict[str, int]]:
    return {name: dict.fromkeys(PROPOSER_COUNTERS, 0) for name in PROPOSERS}


@dataclass
class EngineStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [K]: drafts whose token i was accepted
    num_generated_tokens: int = 0  # tokens that ended up in completions
    num_steps: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    prefill_tokens: int = 0
    prompt_tokens_reused: int = 0  # prompt tokens not prefilled: a head another prompt left in the cache
    time_prefill_s: float = 0.0
    time_draft_s: float = 0.0  # draft forward passes while proposing
    time_target_s: float = 0.0  # target forward passes while verifying / decoding
    time_total_s: float = 0.0  # wall time inside generate()
    by_proposer: dict[str, dict[str, int]] = field(default_factory=empty_by_proposer)
    k_steps: dict[int, int] = field(default_factory=dict)  # k -> steps that proposed k draft tokens
    # Summed seconds and counts per kind of timed work, keyed `draft@B` (one draft forward), `target:N@B`
    # (one target forward with N tokens a row) and `step:k@B` (a whole step proposing k), at B rows; the
    # benchmark reads its cost ratio c and t_verify from the means.
    timed_seconds: dict[str, float] = field(default_factory=dict)
    timed_counts: dict[str, int] = field(default_factory=dict)

    def add_time(self, key: str, seconds: float, count: int = 1) -> None:
        self.timed_seconds[key] = self.timed_seconds.get(key, 0.0) + seconds
        self.timed_counts[key] = self.timed_counts.get(key, 0) + count

    @classmethod
    def for_k(cls, max_k: int) -> EngineStats:
        """Empty counters for an engine proposing at most `max_k` draft tokens a step."""
        return cls(accepted_per_position=[0] * max_k)

    def observe_drafts(self, sources: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Book one step's drafts, in total and by proposer (vLLM's `SpecDecodingStats.observe_draft`):
        sources, drafted, accepted are [rows] of the live rows."""
        self.num_drafts += int((drafted > 0).sum())
        self.num_draft_tokens += int(drafted.sum())
        self.num_accepted_tokens += int(accepted.sum())
        # accepted_per_position[i] counts the rows that accepted more than i tokens
        max_k = len(self.accepted_per_position)
        at_least = np.bincount(accepted, minlength=max_k + 1)[::-1].cumsum()[::-1]  # [K + 1]
        for i, count in enumerate(at_least[1 : max_k + 1].tolist()):
            self.accepted_per_position[i] += count
        for source, name in enumerate(PROPOSERS):
            mine = (sources == source) & (drafted > 0)
            if mine.any():
                counters = self.by_proposer[name]
                counters["drafts"] += int(mine.sum())
                counters["draft_tokens"] += int(drafted[mine].sum())
                counters["accepted_tokens"] += int(accepted[mine].sum())

    def observe_step(self, rows: int, k: int, *, t_draft: float, t_target: float, t_step: float) -> None:
        """Book one step of `rows` rows proposing k draft tokens, and its measured times."""
        self.num_steps += 1
        self.time_draft_s += t_draft
        self.time_target_s += t_target
        self.k_steps[k] = self.k_steps.get(k, 0) + 1
        if k:
            self.add_time(f"draft@{rows}", t_draft, count=k)
        self.add_time(f"target:{k + 1}@{rows}", t_target)
        self.add_time(f"step:{k}@{rows}", t_step)

    def mean_seconds(self) -> dict[str, float]:
        return {key: self.timed_seconds[key] / n for key, n in self.timed_counts.items() if n}

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.time_total_s if self.time_total_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            acceptance_rate=self.acceptance_rate,
            mean_acceptance_length=self.mean_acceptance_length,
            tokens_per_second=self.tokens_per_second,
            mean_seconds=self.mean_seconds(),
        )
        return out
