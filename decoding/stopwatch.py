"""Phase times of a step without a host sync: CUDA events on a GPU, the wall clock on a CPU (whose work is
already synchronous)."""

from __future__ import annotations

import time

import torch


class Stopwatch:
    """Marks the boundaries of a step's phases; `seconds` reads the durations once the step has synced."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: list[torch.cuda.Event] = []
        self.times: list[float] = []
        self.mark()

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
