"""The one progress display of the CLI, on stderr: done/total, ETA, tokens/s, acceptance rate.

On a terminal it is a live bar (rich). Elsewhere (a log file, a CI job, `2>` a pipe) a bar would be
control codes, so it is a plain line every PLAIN_EVERY_S seconds instead, as vLLM logs its progress.
"""

from __future__ import annotations

import sys
import time
from typing import Self

PLAIN_EVERY_S = 5.0  # seconds between plain progress lines


class ProgressBar:
    def __init__(self, label: str, total: int | None, show: bool) -> None:
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
            TextColumn("acceptance {task.fields[acceptance]:.2f}"),
            TextColumn("{task.fields[failed]}"),
            console=console,
            disable=not show or self.plain,
        )
        self.task = self.progress.add_task(label, total=total, rate=0.0, acceptance=0.0, failed="")
        self.label, self.total = label, total
        self._last_line = time.monotonic()  # the first plain line comes one period in: short runs print none

    def __enter__(self) -> Self:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)

    def set_total(self, total: int) -> None:
        self.total = total
        self.progress.update(self.task, total=total)

    def update(self, done: int, tokens_per_second: float, acceptance_rate: float, failed: int = 0) -> None:
        self.progress.update(
            self.task,
            completed=done,
            rate=tokens_per_second,
            acceptance=acceptance_rate,
            failed=f"{failed} failed" if failed else "",
        )
        now = time.monotonic()
        if self.plain and now - self._last_line >= PLAIN_EVERY_S:
            self._last_line = now
            total = "?" if self.total is None else self.total
            sys.stderr.write(
                f"{self.label}: {done}/{total} done, {failed} failed, {tokens_per_second:.1f} tok/s, "
                f"acceptance {acceptance_rate:.2f}\n"
            )
            sys.stderr.flush()
