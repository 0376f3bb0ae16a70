"""`specq submit INPUT.jsonl [gen options] [--wait]`: store a job and queue it; its id alone on stdout."""

from __future__ import annotations

import threading
from typing import Any

import click

from cli.main import cli
from cli.options import (
    broker_option,
    database_option,
    generation_options,
    input_limit_options,
    pop_generation_options,
    pop_input_limits,
    specq_errors,
)


class JobProgress:
    """A rich progress bar on stderr: done/total, ETA, tokens/s, acceptance rate."""

    def __init__(self, job_id: str, total: int, show: bool) -> None:
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
            transient=False,
        )
        self.task = self.progress.add_task(f"job {job_id}", total=total, rate=0.0, acceptance=0.0, failed="")

    def __enter__(self) -> JobProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(None, None, None)

    def update(self, status: dict[str, Any]) -> None:
        self.progress.update(
            self.task,
            completed=status["completed"] + status["failed"],
            rate=status["tokens_per_second"],
            acceptance=status["acceptance_rate"],
            failed=f"{status['failed']} failed" if status["failed"] else "",
        )

    @staticmethod
    def summary(status: dict[str, Any]) -> None:
        click.echo(
            f"job {status['id']} {status['state']}: {status['completed']} completed, {status['failed']} failed "
            f"of {status['total']}; {status['generated_tokens']} tokens at {status['tokens_per_second']:.1f}/s, "
            f"acceptance rate {status['acceptance_rate']:.3f}, "
            f"mean acceptance length {status['mean_acceptance_length']:.2f}",
            err=True,
        )


@cli.command("submit")
@click.argument("input_path", metavar="INPUT.jsonl", type=click.Path(exists=True, dir_okay=False))
@generation_options
@click.option(
    "--wait", is_flag=True, help="Show a progress bar on stderr and return when the job ends (exit 1 if it failed)."
)
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="A request whose worker dies this many times while running it fails, with that error.",
)
@input_limit_options
@database_option
@broker_option
def submit(
    input_path: str,
    wait: bool,
    max_attempts: int,
    database_url: str | None,
    broker_url: str | None,
    **options: Any,
) -> None:
    """Validate the whole file, store the job and enqueue it; print the job id.

    With no broker (no --broker-url, no SPECQ_BROKER_URL) the job runs here, in this process, through
    the workers' own code, and is stored in the database all the same.
    """
    gen = pop_generation_options(options)
    limits = pop_input_limits(options)
    with specq_errors():
        from jobs.services import broker_url as resolve_broker
        from jobs.submit import JobSpec, submit_job

        broker = resolve_broker(broker_url)
        spec = JobSpec(
            target=gen.target,
            draft=gen.draft,
            decoding=gen.decoding.to_dict(),
            sampling=gen.sampling,
            device=gen.device,
            dtype=gen.dtype,
            max_attempts=max_attempts,
        )
        submitted = submit_job(input_path, spec, database_url=database_url, broker=broker, limits=limits)
    click.echo(submitted.job_id)
    click.echo(
        f"job {submitted.job_id}: {submitted.total} requests in {len(submitted.chunks)} chunks"
        + (", running here (no broker)" if submitted.embedded else ", queued"),
        err=True,
    )

    worker: threading.Thread | None = None
    failure: list[BaseException] = []
    if submitted.embedded:
        from jobs.embedded import run_chunks_here

        def work() -> None:
            try:
                run_chunks_here(submitted.db, submitted.chunks, gen.device)
            except BaseException as exc:  # reported by the main thread
                failure.append(exc)

        worker = threading.Thread(target=work, name="specq-embedded", daemon=True)
        worker.start()
    if not wait and worker is None:
        return

    from jobs.control import cancel_job
    from jobs.status import live_workers
    from jobs.wait import wait_for_job

    if worker is None and not live_workers(submitted.db):
        click.echo("no live workers yet: start one with `specq worker`", err=True)

    progress = JobProgress(submitted.job_id, submitted.total, show=wait)
    try:
        with specq_errors(), progress:
            status = wait_for_job(
                submitted.db,
                submitted.job_id,
                progress.update,
                give_up=lambda: worker is not None and not worker.is_alive(),
            )
    except KeyboardInterrupt:
        if worker is not None:  # the in-process work dies with this process: say so in the store
            cancel_job(submitted.db, submitted.job_id)
            click.echo(f"interrupted: job {submitted.job_id} cancelled; `specq retry` resumes it", err=True)
        raise SystemExit(130) from None
    if failure:
        raise click.ClickException(f"job {submitted.job_id} stopped: {failure[0]}")
    progress.summary(status)
    if wait and status["state"] != "completed":
        raise click.ClickException(f"job {submitted.job_id} {status['state']}")
