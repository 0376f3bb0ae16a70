"""The one progress display of the CLI, on stderr: done/total, ETA, tokens/s, acceptance rate (`n/a` until a
draft token was proposed, and for target-only decoding, where none ever is).

On a terminal it is a live bar (rich). Elsewhere (a log file, a CI job, `2>` a pipe) a bar would be
control codes, so it is a plain line every PLAIN_EVERY_S seconds instead, as vLLM logs its progress.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Self

PLAIN_EVERY_S = 5.0  # seconds between plain progress lines
NOT_APPLICABLE = "n/a"  # an acceptance figure where no draft token was proposed: no rate, not a rate of 0


def counted(n: int, noun: str) -> str:
    """`1 chunk`, `2 chunks`: a count with its noun, singular for one."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def rate_text(rate: float | None, digits: int = 3) -> str:
    """A rate with `digits` decimals, or n/a for None."""
    return NOT_APPLICABLE if rate is None else f"{rate:.{digits}f}"


def acceptance_summary(draft_tokens: int, acceptance_rate: float, mean_acceptance_length: float) -> str:
    """The acceptance part of a run's or a job's last line; n/a where nothing was proposed (target-only)."""
    if not draft_tokens:
        return "acceptance n/a (no draft tokens proposed)"
    return f"acceptance rate {acceptance_rate:.3f}, mean acceptance length {mean_acceptance_length:.2f}"


class ProgressBar:
    def __init__(self, label: str, total: int | None, show: bool, clock: Callable[[], float] = time.monotonic) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        self.plain = show and not console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[rate]:>8.1f} tok/s"),
            TextColumn("acceptance {task.fields[acceptance]}"),
            TextColumn("{task.fields[failed]}"),
            TextColumn("{task.fields[note]}"),
            console=console,
            disable=not show or self.plain,
        )
        self.task = self.progress.add_task(label, total=total, rate=0.0, acceptance=NOT_APPLICABLE, failed="", note="")
        self.label, self.total = label, total
        self.clock = clock
        self._last_line = clock()  # the first plain line comes one period in: short runs print none
        self._latest = ""  # the plain line of the latest update, printed or not
        self._printed = ""
        self._note = ""

    def __enter__(self) -> Self:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)
        if self.plain and self._latest != self._printed:  # the log ends on the final count, not a period's
            self._print(self._latest)

    def set_total(self, total: int) -> None:
        self.total = total
        self.progress.update(self.task, total=total)

    def update(
        self, done: int, tokens_per_second: float, acceptance_rate: float | None, failed: int = 0, note: str = ""
    ) -> bool:
        """`acceptance_rate`: None while no draft token was proposed (shown as n/a). `note`: what the work is
        doing besides decoding (training its draft), shown after the figures; a new note is a plain line
        at once. Returns whether it wrote a plain line."""
        acceptance = rate_text(acceptance_rate, 2)
        self.progress.update(
            self.task,
            completed=done,
            rate=tokens_per_second,
            acceptance=acceptance,
            failed=f"{failed} failed" if failed else "",
            note=note,
        )
        total = "?" if self.total is None else self.total
        self._latest = (
            f"{self.label}: {done}/{total} done, {failed} failed, {tokens_per_second:.1f} tok/s, "
            f"acceptance {acceptance}" + (f", {note}" if note else "")
        )
        now = self.clock()
        noted, self._note = note != self._note, note
        if self.plain and (now - self._last_line >= PLAIN_EVERY_S or (noted and note)):
            self._last_line = now
            self._print(self._latest)
            return True
        return False

    def _print(self, line: str) -> None:
        self._printed = line
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
