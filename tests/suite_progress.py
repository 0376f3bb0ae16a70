"""The suite's progress line (tests/conftest.py): every PROGRESS_EVERY_S, the tests done of all, the minutes
in and about how many are left.

The minutes left are the tests left at the rate of the last RATE_WINDOW_S, not of the whole run: the suite's
rate changes as it goes (the longest files first, quick unit tests in between, one process working alone at
the end), and the whole run's average, pulled by a quick start, made the estimate grow on every line while the
tests went at a steady rate. Over a window it follows the rate of the tests now running, and steady work
makes it shrink line after line."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

PROGRESS_EVERY_S = 30.0  # a line every half minute: the suite takes minutes, more on a busy machine
RATE_WINDOW_S = 180.0  # the rate of the last three minutes: six lines, many files' worth of tests


class SuiteProgress:
    """Counts finished tests on `clock` and says, when a line is due, how far the suite is."""

    def __init__(self, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.done = 0
        self.clock = clock
        self.started = self.shown = clock()
        self._recent: deque[float] = deque()  # when the tests of the last RATE_WINDOW_S finished

    def finished(self) -> str | None:
        """Count one finished test; the progress line where one is due (never after the last test)."""
        now = self.clock()
        self.done += 1
        self._recent.append(now)
        while self._recent[0] <= now - RATE_WINDOW_S:
            self._recent.popleft()
        if now - self.shown < PROGRESS_EVERY_S or self.done == self.total:
            return None
        self.shown = now
        elapsed = now - self.started
        rate = len(self._recent) / min(elapsed, RATE_WINDOW_S)  # tests a second
        left = (self.total - self.done) / rate
        return f"-- {self.done} of {self.total} tests, {elapsed / 60:.1f} min in; about {left / 60:.1f} min left"
