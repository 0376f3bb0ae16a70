"""`specq submit INPUT.jsonl [gen options] [--wait]`: store a job and queue it; its id alone on stdout."""

from __future__ import annotations

import threading
from typing import Any

import click

from specq.cli.group import cli
from specq.cli.options import (
    broker_option,
    database_option,
    generation_options,
    input_limit_options,
    pop_generation_options,
    pop_input_limits,
    specq_errors,
)
from specq.cli.progress import ProgressBar


def _summary(status: dict[str, Any]) -> None:
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
        from specq.jobs.services import broker_url as resolve_broker
        from specq.jobs.submit import JobSpec, submit_job

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
        from specq.worker.embedded import run_chunks_here

        def work() -> None:
            try:
                run_chunks_here(submitted.db, submitted.chunks, gen.device)
            except BaseException as exc:  # reported by the main thread
                failure.append(exc)

        worker = threading.Thread(target=work, name="specq-embedded", daemon=True)
        worker.start()
    if not wait and worker is None:
        return

    from specq.jobs.control import cancel_job
    from specq.jobs.status import live_workers
    from specq.jobs.wait import wait_for_job

    if worker is None and not live_workers(submitted.db):
        click.echo("no live workers yet: start one with `specq worker`", err=True)

    progress = ProgressBar(f"job {submitted.job_id}", submitted.total, show=wait)

    def show(status: dict[str, Any]) -> None:
        done = status["completed"] + status["failed"]
        progress.update(done, status["tokens_per_second"], status["acceptance_rate"], status["failed"])

    try:
        with specq_errors(), progress:
            status = wait_for_job(
                submitted.db,
                submitted.job_id,
                show,
                give_up=lambda: worker is not None and not worker.is_alive(),
            )
    except KeyboardInterrupt:
        if worker is not None:  # the in-process work dies with this process: say so in the store
            cancel_job(submitted.db, submitted.job_id)
            click.echo(f"interrupted: job {submitted.job_id} cancelled; `specq retry` resumes it", err=True)
        raise SystemExit(130) from None
    if failure:
        raise click.ClickException(f"job {submitted.job_id} stopped: {failure[0]}")
    _summary(status)
    if wait and status["state"] != "completed":
        raise click.ClickException(f"job {submitted.job_id} {status['state']}")
