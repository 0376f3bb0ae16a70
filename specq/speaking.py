"""Never silent for long: every phase of a command says something at least every SILENCE_LIMIT_S seconds.

A phase that reports its own progress (a bar, a line per step) marks each line it writes (`Speaker.spoke`);
one that can sit inside a single slow call (a model's load, a compile, a warm-up step, a wait on another
process) runs under `Speaker.watching`, whose thread says `still <what>` when nothing else was said
for EVERY_S seconds. The clock and the thread's pause are injectable, so tests run phases on a fake clock
and check the gaps between lines without waiting for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SILENCE_LIMIT_S = 30.0  # the README's promise: a line at least this often, on a pipe as on a terminal
EVERY_S = 15.0  # what a quiet phase aims for: half the limit, so a slow check or a busy CPU still keeps it
CHECK_S = 1.0  # how often the watching thread looks at the clock

Say = Callable[[str], None]
Clock = Callable[[], float]


class Speaker:
    """Says lines through `say`, and knows when it last did, on `clock`."""

    def __init__(self, say: Say, *, clock: Clock = time.monotonic, every_s: float = EVERY_S) -> None:
        self._say = say
        self.clock = clock
        self.every_s = every_s
        self.last_spoke = clock()
        self._lock = threading.Lock()

    def say(self, line: str) -> None:
        with self._lock:
            self._say(line)
            self.last_spoke = self.clock()

    def spoke(self) -> None:
        """Note a line written elsewhere (a progress bar's plain line): the silence starts again."""
        self.last_spoke = self.clock()

    def due(self) -> bool:
        return self.clock() - self.last_spoke >= self.every_s

    def still(self, what: Callable[[], str]) -> None:
        """Say `still <what()>` where the silence has lasted `every_s`."""
        if self.due():
            self.say(f"still {what()}")

    @contextmanager
    def watching(
        self, what: str | Callable[[], str], *, pause: Callable[[threading.Event], bool] | None = None
    ) -> Iterator[None]:
        """Within the block, a thread says `still <what> (Ns)` (a callable `what` gives its own text) whenever
        nothing was said for `every_s`. `pause(stop)` waits between looks and returns True once the block
        ended (default: CHECK_S seconds of real time; a test passes a short one and runs a fake clock)."""
        started = self.clock()
        describe = what if callable(what) else (lambda: f"{what} ({self.clock() - started:.0f}s)")
        stop = threading.Event()
        wait = pause or (lambda event: event.wait(CHECK_S))

        def watch() -> None:
            while not wait(stop):
                self.still(describe)

        watcher = threading.Thread(target=watch, name="specq-speaking", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()
