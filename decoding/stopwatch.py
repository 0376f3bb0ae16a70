"""Phase times of a step without a host sync: CUDA events on a GPU, the wall clock on a CPU (whose work is
already synchronous); and whether the step compiled a graph, whose time is then the compiler's.

A compiled model compiles lazily the graphs its load did not: a width of verify it first meets (a
`--draft train:N` job's first speculative step, after target-only steps of width 1), a row count that
first varies. That step takes seconds where the next takes milliseconds. The policy that learnt from it
(decoding/k_policy.py) took every width near it for dear, rested, and rarely measured it again: a
SmolLM2 `train:100` job drafted 8 tokens in 20 requests for the rest of its run, at target-only's speed."""

from __future__ import annotations

import time

import torch


class Stopwatch:
    """Marks the boundaries of a step's phases; `seconds` reads the durations once the step has synced.
    With `compiled` (a model of the step is compiled), `compiled_a_graph` says whether it compiled one."""

    def __init__(self, device: torch.device, compiled: bool = False) -> None:
        self.cuda = device.type == "cuda"
        self.events: list[torch.cuda.Event] = []
        self.times: list[float] = []
        self._graphs = graphs_compiled() if compiled else None
        self.mark()

    def compiled_a_graph(self) -> bool:
        return self._graphs is not None and graphs_compiled() != self._graphs

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        else:
            self.times.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Durations between consecutive marks; call after the step's sync."""
        if self.cuda:
            self.events[-1].synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.events, self.events[1:], strict=False)]
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


def graphs_compiled() -> int:
    """Graphs torch.compile has compiled in this process so far (a shape first met counts one)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
