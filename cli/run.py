"""`specq run INPUT.jsonl -o OUT.jsonl [gen options]`: generate in this process, no queue, no database."""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from cli.main import cli
from cli.options import generation_options, input_limit_options, pop_generation_options, pop_input_limits, specq_errors


@cli.command("run")
@click.argument("input_path", metavar="INPUT.jsonl", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "-o",
    "--output",
    "output_path",
    type=click.Path(dir_okay=False, writable=True),
    help="Where to write one JSON line per input line, in input order. [default: INPUT.out.jsonl; - for stdout]",
)
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr. [default: when it is a terminal]")
@generation_options
@input_limit_options
def run(input_path: str, output_path: str | None, progress: bool | None, **options: Any) -> None:
    """Generate for every request of INPUT.jsonl here and now, and write the results.

    Exit 0 when every request completed, 1 when any failed (its line then carries the error).
    """
    gen = pop_generation_options(options)
    limits = pop_input_limits(options)
    from jobs.local_run import default_output_path, run_file

    path = output_path or str(default_output_path(input_path))
    show = sys.stderr.isatty() if progress is None else progress
    with specq_errors(), _RunProgress(show) as bar:
        out = sys.stdout if path == "-" else open(path, "w", encoding="utf-8")  # noqa: SIM115
        try:
            summary = run_file(
                input_path,
                out,
                target=gen.target,
                draft=gen.draft,
                decoding=gen.decoding,
                sampling=gen.sampling,
                device=gen.device,
                dtype=gen.dtype,
                on_start=bar.start,
                on_progress=bar.update,
                limits=limits,
            )
        finally:
            if out is not sys.stdout:
                out.close()
    stats = summary.stats
    click.echo(
        f"{summary.completed} completed, {summary.failed} failed of {summary.total}; "
        f"{stats.num_generated_tokens} tokens at {stats.tokens_per_second:.1f}/s, "
        f"acceptance rate {stats.acceptance_rate:.3f}, mean acceptance length {stats.mean_acceptance_length:.2f}"
        + ("" if path == "-" else f"; results in {path}"),
        err=True,
    )
    if summary.failed:
        raise click.exceptions.Exit(1)


class _RunProgress:
    """done/total, tokens/s and acceptance rate on stderr (rich)."""

    def __init__(self, show: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]run"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[rate]:>8.1f} tok/s"),
            TextColumn("acceptance {task.fields[acceptance]:.2f}"),
            console=Console(stderr=True),
            disable=not show,
        )
        self.task = self.progress.add_task("run", total=None, rate=0.0, acceptance=0.0)
        self.started = time.perf_counter()

    def __enter__(self) -> _RunProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)

    def start(self, total: int) -> None:
        self.started = time.perf_counter()
        self.progress.update(self.task, total=total)

    def update(self, done: int, stats: Any) -> None:
        self.progress.update(
            self.task,
            completed=done,
            rate=stats.num_generated_tokens / max(time.perf_counter() - self.started, 1e-9),
            acceptance=stats.acceptance_rate,
        )
