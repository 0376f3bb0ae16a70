"""Never silent for long: every phase of a command says something at least every SILENCE_LIMIT_S seconds.

A phase that reports its own progress (a bar, a line per step) marks each line it writes (`Speaker.spoke`);
one that can sit inside a single slow call (a model's load, a compile, a warm-up step, a wait on another
process) runs under `Speaker.watching`, whose thread says `still <what>` when nothing else was said
for EVERY_S seconds. A command of many phases, some quick steps and some one slow call, tells `Phases` where
it is: a phase's first line is said at once, how far it got (prompts done, forwards timed) only where a silence
needs it, and the watcher's `still` line repeats the latest of them. The clock and the thread's pause are
injectable, so tests run phases on a fake clock and check the gaps between lines without waiting for them.
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
Pause = Callable[[threading.Event], bool]  # the watcher's wait between looks: True once the block ended


class Speaker:
    """Says lines through `say`, and knows when it last did, on `clock`. `pause`: how `watching`'s thread
    waits between looks (default: CHECK_S seconds of real time)."""

    def __init__(
        self, say: Say, *, clock: Clock = time.monotonic, every_s: float = EVERY_S, pause: Pause | None = None
    ) -> None:
        self._say = say
        self.clock = clock
        self.every_s = every_s
        self.pause = pause
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
    def watching(self, what: str | Callable[[], str], *, pause: Pause | None = None) -> Iterator[None]:
        """Within the block, a thread says `still <what> (Ns)` (a callable `what` gives its own text) whenever
        nothing was said for `every_s`. `pause(stop)` waits between looks and returns True once the block
        ended (default: the speaker's; a test passes a short one and runs a fake clock)."""
        started = self.clock()
        describe = what if callable(what) else (lambda: f"{what} ({self.clock() - started:.0f}s)")
        stop = threading.Event()
        wait = pause or self.pause or (lambda event: event.wait(CHECK_S))

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


class Phases:
    """A long command's phases on one speaker (`specq bench`: loading, each contender's passes, the roofline).

    `begin` says a phase's first line at once. `reached` notes how far the phase got (prompts done of all,
    forwards timed) and says it only where the silence has lasted the speaker's `every_s`: a stream of quick
    steps makes a line every `every_s`, not one a step. `busy` is the text of the watcher's `still` line,
    for a silence inside one slow call (a load, a batch's `generate`): the latest of those lines, with the
    seconds since its phase began."""

    def __init__(self, speaker: Speaker, first: str) -> None:
        self.speaker = speaker
        self._latest, self._began = first, speaker.clock()

    def begin(self, line: str) -> None:
        self._latest, self._began = line, self.speaker.clock()
        self.speaker.say(line)

    def reached(self, line: str) -> None:
        self._latest = line
        if self.speaker.due():
            self.speaker.say(line)

    def busy(self) -> str:
        return f"{self._latest} ({self.speaker.clock() - self._began:.0f}s)"
