"""When a batch refills its free rows, and when a drained batch drops them.

The rows of a speculating batch end on different steps (each row accepts its own count of draft
tokens), so most of a job runs with a few rows free. A free row costs in one of two ways:

- while requests wait, the tokens it does not produce: its share of each step's time, as if the batch
  were full. Refilling it costs a prefill forward's fixed cost (decoding/prefill_groups.py), paid once
  however many rows that refill fills;
- once none waits, the compute each step still spends on it. Dropping the free rows (compaction,
  decoding/batch.py) copies the live rows' caches once.

Both are ski rental: pay the one-off cost once what idling ran up since the last refill or compaction
reaches it, which costs at most twice the best choice made knowing the future. The refill also looks
ahead where it can: a live row ends within the tokens it may still add (max_tokens, the context), one
a step at least. Waiting for the next row to end is worth one forward's fixed cost at most (the
refill it joins instead of paying for one of its own), so where that wait would cost more, the free
rows are refilled now. A batch whose rows all end together never idles; one a speculating policy
spread out refills its first free rows early rather than idle them until the next row ends long after.

A step's time grows less than in proportion to its rows (a forward's fixed cost is a large share of a
small batch's step), so pricing a drained batch's free rows at their share of the step overstates
them: it compacts sooner than it needs to, by at most the price of one compaction.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


class IdleRows:
    """The idle time a batch's free rows ran up, and whether to refill or compact them now."""

    def __init__(self, batch_size: int, device: torch.device) -> None:
        self.batch_size = batch_size
        self.cuda = device.type == "cuda"
        self._idled_s = 0.0  # free rows' share of the steps since the last refill or compaction
        self._step_s = 0.0  # the last step's time
        self._compaction_s: float | None = None  # the last compaction's time, once read
        # on a GPU: the CUDA events of a compaction not yet read, resolved once done (no host sync)
        self._pending: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def stepped(self, t_step: float, live: int, rows: int) -> None:
        """A step of a batch of `rows` rows, `live` of them live, took `t_step` seconds."""
        self._step_s = t_step
        self._idled_s += t_step * (rows - live) / rows

    def refill_due(self, tokens_left: np.ndarray, overhead_s: float) -> bool:
        """Whether to refill the free rows now, beside live rows that may each add `tokens_left` [live]
        more tokens, a refill's forwards costing `overhead_s` beyond their tokens: at once when no row is
        live; when idling since the last refill cost that much; or when waiting for the next live row to
        end would."""
        free = self.batch_size - tokens_left.size
        if free == 0:
            return False
        if tokens_left.size == 0 or self._idled_s >= overhead_s:
            return True
        steps_to_next_end = max(int(tokens_left.min()), 1)
        return steps_to_next_end * self._step_s * free / self.batch_size >= overhead_s

    def refilled(self) -> None:
        self._idled_s = 0.0

    def compaction_due(self) -> bool:
        """Whether a drained batch's free rows idled through as much time as dropping them costs (until a
        compaction is timed: a step's)."""
        return self._idled_s > 0.0 and self._idled_s >= self._compaction_seconds()

    @contextmanager
    def compacting(self) -> Iterator[None]:
        """Time the compaction run inside the block."""
        if not self.cuda:
            started = time.perf_counter()
            yield
            self._compaction_s = time.perf_counter() - started
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending = (start, end)
        self._idled_s = 0.0

    def _compaction_seconds(self) -> float:
        if self._pending is not None and self._pending[1].query():
            start, end = self._pending
            self._compaction_s = start.elapsed_time(end) / 1000.0
            self._pending = None
        return self._step_s if self._compaction_s is None else self._compaction_s
