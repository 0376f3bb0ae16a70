"""Fault injection for the recovery drills and their tests: inert unless its variables are set.

- `SPECQ_FAULT_OOM_ABOVE=N`: the engine runs out of device memory (`torch.OutOfMemoryError`) whenever
  a batch would hold more than N requests at once, as a device too small for the batch size does;
- `SPECQ_FAULT_CRASH_PROMPT=TEXT`: the worker process kills itself with SIGKILL (as the kernel's OOM
  killer, or a fault in a kernel, would) when a request whose prompt contains TEXT enters the engine.

Both are read on every use, so a test may set them in its own process (the embedded path) as well as in
a worker's environment.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

OOM_ABOVE_ENV = "SPECQ_FAULT_OOM_ABOVE"
CRASH_PROMPT_ENV = "SPECQ_FAULT_CRASH_PROMPT"


def oom_above() -> int | None:
    """The most requests a batch may hold before the simulated out-of-memory error; None: no limit."""
    value = os.environ.get(OOM_ABOVE_ENV)
    return max(1, int(value)) if value else None


def simulated_oom(rows: int, limit: int) -> BaseException:
    import torch

    error = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    return error(f"simulated: a batch of {rows} requests does not fit (at most {limit}; {OOM_ABOVE_ENV})")


def maybe_crash(prompt: str | None) -> None:
    """Kill this process at once when the prompt holds the crash marker."""
    marker = os.environ.get(CRASH_PROMPT_ENV)
    if marker and prompt is not None and marker in prompt:
        log.error("fault injection: request prompt holds %s; killing this worker", CRASH_PROMPT_ENV)
        os.kill(os.getpid(), signal.SIGKILL)
