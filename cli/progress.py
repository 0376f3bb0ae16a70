"""The one progress bar of the CLI (rich, on stderr): done/total, ETA, tokens/s, acceptance rate."""

from __future__ import annotations

from typing import Self


class ProgressBar:
    def __init__(self, label: str, total: int | None, show: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[rate]:>8.1f} tok/s"),
            TextColumn("acceptance {task.fields[acceptance]:.2f}"),
            TextColumn("{task.fields[failed]}"),
            console=Console(stderr=True),
            disable=not show,
        )
        self.task = self.progress.add_task(label, total=total, rate=0.0, acceptance=0.0, failed="")

    def __enter__(self) -> Self:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)

    def set_total(self, total: int) -> None:
        self.progress.update(self.task, total=total)

    def update(self, done: int, tokens_per_second: float, acceptance_rate: float, failed: int = 0) -> None:
        self.progress.update(
            self.task,
            completed=done,
            rate=tokens_per_second,
            acceptance=acceptance_rate,
            failed=f"{failed} failed" if failed else "",
        )
