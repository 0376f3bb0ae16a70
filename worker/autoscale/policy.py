"""How many workers the backlog wants: a pure function of (backlog, running workers, time).

- *desired*: ceil(backlog / backlog_per_worker), clamped to [min, max]; a backlog of 0 desires `min`
  (scale to zero when min is 0), any backlog at all desires at least one worker;
- scale up at once: when desired >= running, wanted = desired;
- scale down late: when desired < running, the time it first did so is kept (`low_since`), and wanted
  stays at running until that stretch has lasted `cooldown_s`; then wanted = desired. Any tick whose
  desired is back at running or above ends the stretch.

The state is a value passed in and returned, so the policy is tested without clocks or processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from specq.worker.autoscale.config import AutoscaleConfig


@dataclass(frozen=True)
class PolicyState:
    low_since: float | None = None  # start of the current stretch of "fewer workers would do"


@dataclass(frozen=True)
class Decision:
    wanted: int  # workers to have running after this tick
    desired: int  # what the backlog alone asks for
    reason: str  # a few words for the log line
    state: PolicyState  # pass to the next call


def desired_workers(config: AutoscaleConfig, backlog: int) -> int:
    """The workers a backlog of `backlog` requests asks for, within [min, max]."""
    needed = -(-max(backlog, 0) // config.backlog_per_worker)  # ceil
    return max(config.min_workers, min(config.max_workers, needed))


def decide(config: AutoscaleConfig, state: PolicyState, backlog: int, running: int, now: float) -> Decision:
    """The workers wanted now; `now` is any monotonic clock in seconds."""
    desired = desired_workers(config, backlog)
    if desired > running:
        return Decision(desired, desired, "scale up", PolicyState())
    if desired == running:
        return Decision(desired, desired, "steady", PolicyState())
    if running > config.max_workers:
        return Decision(desired, desired, "above max", PolicyState())
    low_since = now if state.low_since is None else state.low_since
    low_for = now - low_since
    if low_for >= config.cooldown_s:
        return Decision(desired, desired, f"scale down after {low_for:.0f}s of low backlog", PolicyState())
    return Decision(
        running, desired, f"low backlog for {low_for:.0f}s of {config.cooldown_s:.0f}s", PolicyState(low_since)
    )
