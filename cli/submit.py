"""`specq submit INPUT.jsonl [gen options] [--wait]`: store a job and queue it; its id alone on stdout."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from specq.cli.group import cli
from specq.cli.options import (
    GenerationOptions,
    broker_option,
    database_option,
    generation_options,
    input_limit_options,
    patient_reads,
    specq_errors,
)
from specq.cli.progress import ProgressBar

if TYPE_CHECKING:
    from specq.jobs.inputs import InputLimits
    from specq.jobs.patience import Patient
    from specq.jobs.submit import Submitted


def _summary(status: dict[str, Any]) -> None:
    click.echo(
        f"job {status['id']} {status['state']}: {status['completed']} completed, {status['failed']} failed "
        f"of {status['total']}; {status['generated_tokens']} tokens at {status['tokens_per_second']:.1f}/s, "
        f"acceptance rate {status['acceptance_rate']:.3f}, "
        f"mean acceptance length {status['mean_acceptance_length']:.2f}",
        err=True,
    )


@cli.command("submit")
@click.argument("input_path", metavar="INPUT.jsonl", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
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
    generation: GenerationOptions,
    input_limits: InputLimits,
) -> None:
    """Validate the whole file (- for standard input, read once), store the job and enqueue it; print the job id.

    With no broker (no --broker-url, no SPECQ_BROKER_URL) the job runs here, in this process, through
    the workers' own code, and is stored in the database all the same.
    """
    with specq_errors():
        from specq.jobs.services import broker_url as resolve_broker
        from specq.jobs.submit import JobSpec, submit_job

        broker = resolve_broker(broker_url)
        spec = JobSpec(
            target=generation.target,
            draft=generation.draft,
            decoding=generation.decoding.to_dict(),
            sampling=generation.sampling,
            device=generation.device,
            dtype=generation.dtype,
            max_attempts=max_attempts,
            chat_template=generation.chat_template,
            served_model_name=generation.served_model_name,
        )
        submitted = submit_job(input_path, spec, database_url=database_url, broker=broker, limits=input_limits)
    click.echo(submitted.job_id)
    click.echo(
        f"job {submitted.job_id}: {submitted.total} requests in {len(submitted.chunks)} chunks"
        + (", running here (no broker)" if submitted.embedded else ", queued"),
        err=True,
    )
    if not wait and not submitted.embedded:
        return
    patient = patient_reads() if not submitted.embedded else None
    if patient is not None:
        from specq.jobs.status import live_workers

        with specq_errors():
            workers = patient(lambda: live_workers(submitted.db))
        if not workers:
            click.echo("no live workers yet: start one with `specq worker`", err=True)

    progress = ProgressBar(f"job {submitted.job_id}", submitted.total, show=wait)

    def show(status: dict[str, Any]) -> None:
        done = status["completed"] + status["failed"]
        progress.update(done, status["tokens_per_second"], status["acceptance_rate"], status["failed"])

    try:
        with specq_errors(), progress:
            status = _until_done(submitted, generation.device, show, patient)
    except KeyboardInterrupt:
        if submitted.embedded:  # the job was cancelled: its in-process work dies with this process
            click.echo(f"interrupted: job {submitted.job_id} cancelled; `specq retry` resumes it", err=True)
        raise SystemExit(130) from None
    _summary(status)
    if wait and status["state"] != "completed":
        raise click.ClickException(f"job {submitted.job_id} {status['state']}")


def _until_done(
    submitted: Submitted, device: str | None, show: Callable[[dict[str, Any]], None], patient: Patient | None
) -> dict[str, Any]:
    """Run the job here (no broker) or wait for the workers, riding out database outages, until it
    ends; its last status."""
    if submitted.embedded:
        from specq.worker.embedded import run_job_here

        return run_job_here(submitted.db, submitted.job_id, submitted.chunks, device, show)
    from specq.jobs.wait import wait_for_job

    return wait_for_job(submitted.db, submitted.job_id, show, patient=patient)
