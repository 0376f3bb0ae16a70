"""Fault injection for the recovery drills and their tests: inert unless its variables are set.

- `SPECQ_FAULT_OOM_ABOVE=N`: the engine runs out of device memory (`torch.OutOfMemoryError`) whenever
  a batch would hold more than N requests at once, as a device too small for the batch size does;
- `SPECQ_FAULT_CRASH_PROMPT=TEXT`: the worker process kills itself with SIGKILL (as the kernel's OOM
  killer, or a fault in a kernel, would) when a request whose prompt contains TEXT enters the engine;
- `SPECQ_FAULT_TRAINING_TICK_S=S`: the clock a `--draft train:N` job's training phase runs by advances S
  seconds at each reading (after each sequence the target reads, after each step), as on a machine
  that slow, so a test knows how many readings a budget lasts whatever the machine's speed.

`installed()` reads them once per chunk, so a test may set them in its own process (the embedded path)
as well as in a worker's environment; with neither set it returns None and the chunk checks nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

OOM_ABOVE_ENV = "SPECQ_FAULT_OOM_ABOVE"
CRASH_PROMPT_ENV = "SPECQ_FAULT_CRASH_PROMPT"
TRAINING_TICK_ENV = "SPECQ_FAULT_TRAINING_TICK_S"


def oom_above() -> int | None:
    """The most requests a batch may hold before the simulated out-of-memory error; None: no limit."""
    value = os.environ.get(OOM_ABOVE_ENV)
    return max(1, int(value)) if value else None


def simulated_oom(rows: int, limit: int) -> BaseException:
    import torch

    error = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    return error(f"simulated: a batch of {rows} requests does not fit (at most {limit}; {OOM_ABOVE_ENV})")


@dataclass(frozen=True)
class Faults:
    """The faults to inject as requests enter the engine."""

    oom_above: int | None = None
    crash_prompt: str | None = None

    def before_entering(self, in_engine: int) -> None:
        """Raise the simulated out-of-memory error when one more request would not fit."""
        if self.oom_above is not None and in_engine >= self.oom_above:
            raise simulated_oom(in_engine + 1, self.oom_above)

    def entering(self, prompt: str | None) -> None:
        """Kill this process at once when the prompt holds the crash marker."""
        if self.crash_prompt and prompt is not None and self.crash_prompt in prompt:
            log.error("fault injection: request prompt holds %s; killing this worker", CRASH_PROMPT_ENV)
            os.kill(os.getpid(), signal.SIGKILL)


def installed() -> Faults | None:
    """The faults set in the environment now; None when there is none."""
    found = Faults(oom_above(), os.environ.get(CRASH_PROMPT_ENV) or None)
    return None if found == Faults() else found


def training_clock() -> Callable[[], float]:
    """The clock a job's draft training reads: the real one, or one that ticks `SPECQ_FAULT_TRAINING_TICK_S`
    seconds a reading."""
    value = os.environ.get(TRAINING_TICK_ENV)
    if not value:
        return time.perf_counter
    tick, readings = float(value), [0]

    def ticking() -> float:
        readings[0] += 1
        return readings[0] * tick

    return ticking
