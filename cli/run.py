"""`specq run INPUT.jsonl -o OUT.jsonl [gen options]`: generate in this process, no queue, no database."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import click

from specq.cli.group import cli
from specq.cli.options import GenerationOptions, InputFile, generation_options, input_limit_options, specq_errors
from specq.cli.progress import ProgressBar, acceptance_summary, counted

if TYPE_CHECKING:
    from specq.jobs.inputs import InputLimits


@cli.command("run")
@click.argument("input_path", metavar="INPUT.jsonl", type=InputFile())
@click.option(
    "-o",
    "--output",
    "output_path",
    type=click.Path(dir_okay=False, writable=True),
    help="Where to write one JSON line per input line, in input order. "
    "[default: INPUT.out.jsonl, stdout for INPUT -; - for stdout]",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(("jsonl", "openai")),
    default="jsonl",
    show_default=True,
    help="jsonl: one result object a line (as `export --format jsonl`); openai: OpenAI Batch API output lines.",
)
@click.option(
    "--progress/--no-progress",
    default=True,
    help="Progress on stderr: a live bar on a terminal, else a plain line every few seconds. [default: on]",
)
@generation_options
@input_limit_options
def run(
    input_path: str,
    output_path: str | None,
    output_format: str,
    progress: bool,
    generation: GenerationOptions,
    input_limits: InputLimits,
) -> None:
    """Generate for every request of INPUT.jsonl (- for standard input) here and now, and write the results.

    Exit 0 when every request completed, 1 when any failed (its line then carries the error).
    """
    from specq.jobs.local_run import default_output_path, run_file

    if generation.draft_training is not None:
        raise click.BadParameter(
            "train:N trains a draft on a job's first N requests as the job runs: use `specq submit` "
            "(or `specq draft train` for a draft folder `run --draft` takes)",
            param_hint="'--draft'",
        )
    path = output_path or default_output_path(input_path)
    # run_file's keyword arguments: the generation options but `draft_training` (None here)
    options = {name: value for name, value in vars(generation).items() if name != "draft_training"}
    with specq_errors(), _RunProgress(progress) as bar:
        summary = run_file(
            input_path,
            path,
            **options,
            output_format=output_format,  # type: ignore[arg-type]
            on_start=bar.start,
            on_loaded=lambda line: click.echo(line, err=True),
            on_progress=bar.progress_of,
            limits=input_limits,
        )
    stats = summary.stats
    # a line with `n` > 1 is n requests (its choices): completions are counted against requests, not lines
    of = str(summary.total)
    if summary.lines != summary.total:
        of = f"{summary.total} requests from {counted(summary.lines, 'line')}"
    click.echo(
        f"{summary.completed} completed, {summary.failed} failed of {of}; "
        f"{stats.num_generated_tokens} tokens at {stats.tokens_per_second:.1f}/s, "
        + acceptance_summary(stats.num_draft_tokens, stats.acceptance_rate, stats.mean_acceptance_length)
        + ("" if path == "-" else f"; results in {path}"),
        err=True,
    )
    if summary.failed:
        raise click.exceptions.Exit(1)


class _RunProgress(ProgressBar):
    """The bar fed by `run_file`: it knows the total once the input is counted, and tokens from the stats."""

    def __init__(self, show: bool) -> None:
        super().__init__("run", total=None, show=show)
        self.started = time.perf_counter()

    def start(self, total: int) -> None:
        self.started = time.perf_counter()
        self.set_total(total)

    def progress_of(self, done: int, failed: int, stats: Any) -> None:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        acceptance = stats.acceptance_rate if stats.num_draft_tokens else None
        # the failures as the summary counts them: a request the engine refused (over the context) among them
        self.update(done, stats.num_generated_tokens / elapsed, acceptance, failed)
