"""`specq cancel JOB`, `specq retry JOB` and `specq delete JOB`."""

from __future__ import annotations

import click

from specq.cli.group import cli
from specq.cli.options import UsageLine, broker_option, database_option, job_argument, specq_errors
from specq.cli.progress import counted
from specq.db.states import JobState


@cli.command("cancel")
@job_argument()
@database_option
def cancel(job: str, database_url: str | None) -> None:
    """Stop a job's remaining work: its queued requests will not run, and the requests workers hold stop
    at the next result each worker stores (ending cancelled); results already stored are kept."""
    with specq_errors():
        from specq.db.session import open_database
        from specq.jobs.control import cancel_job

        outcome = cancel_job(open_database(database_url), job)
    if not outcome.changed:
        if outcome.previous == "cancelled":
            click.echo(f"job {job} was already cancelled", err=True)
            return
        raise click.UsageError(f"job {job} has already ended ({outcome.previous}); nothing to cancel")
    line = f"job {job} cancelled: {counted(outcome.cancelled, 'queued request')} will not run"
    if outcome.running:
        line += (
            f"; workers hold {counted(outcome.running, 'request')}: they stop at the next result each worker "
            "stores and end cancelled (results stored by then are kept)"
        )
    click.echo(line, err=True)


@cli.command("retry")
@job_argument()
@click.option(
    "--device",
    help="Torch device for the in-process run when there is no broker. [default: the --device the job was started "
    "with, else cuda:0 if available, else cpu]",
)
@database_option
@broker_option
def retry(job: str, device: str | None, database_url: str | None, broker_url: str | None) -> None:
    """Requeue a job's failed, cancelled and expired requests, and queue the job again (a cancelled or
    expired one too; an expired job's completion window is lifted).

    With no broker they run here, in this process. Prints how many requests were requeued; a job with
    none to requeue is left as it is (exit 2), as is a cancelled job while requests that were running
    when it was cancelled have not yet been given up by their workers (retry again in a few seconds).
    """
    with specq_errors():
        from specq.db.session import identity, open_database
        from specq.jobs.control import retry_job
        from specq.jobs.enqueue import enqueue_chunks
        from specq.jobs.services import broker_url as resolve_broker
        from specq.jobs.services import check_broker

        broker = resolve_broker(broker_url)
        if broker is not None:
            check_broker(broker)
        db = open_database(database_url)
        outcome = retry_job(db, job, enqueued=broker is not None)
        if outcome.winding_down:
            raise UsageLine(
                f"job {job} is cancelled and {outcome.winding_down} of its requests are still running until their "
                "workers see the cancel; nothing was requeued: retry again in a few seconds"
            )
        if not outcome.chunks:
            raise UsageLine(
                f"job {job} ({outcome.previous}) has no failed, cancelled or expired requests; nothing was requeued"
            )
        change = outcome.state if outcome.state == outcome.previous else f"{outcome.previous} -> {outcome.state}"
        click.echo(f"job {job} ({change}): {_requeued(outcome.requeued)}", err=True)
        if broker is not None:
            enqueue_chunks(broker, outcome.chunks, identity(db))
            return
        from specq.jobs.status import job_status
        from specq.worker.embedded import run_chunks_here

        run_chunks_here(db, outcome.chunks, device or outcome.device)
        status = job_status(db, job)
    click.echo(f"job {job} {status.state}: {status.completed} completed, {status.failed} failed", err=True)
    if status.state != JobState.COMPLETED:
        raise click.ClickException(f"job {job} {status.state}")


def _requeued(by_state: dict[str, int]) -> str:
    """ "3 requests requeued (2 failed, 1 cancelled)"; running ones were abandoned (their lease expired)."""
    words = {"running": "abandoned"}
    parts = ", ".join(f"{n} {words.get(state, state)}" for state, n in sorted(by_state.items()))
    return f"{counted(sum(by_state.values()), 'request')} requeued" + (f" ({parts})" if parts else "")


@cli.command("delete")
@job_argument()
@database_option
def delete(job: str, database_url: str | None) -> None:
    """Delete a job with its requests, results and metrics, in one transaction.

    Refused (exit 2) while the job is queued or running: cancel it first. The job's chunks still on the
    broker are dropped by the workers that take them."""
    with specq_errors():
        from specq.db.session import open_database
        from specq.jobs.control import delete_job

        requests = delete_job(open_database(database_url), job)
    click.echo(f"job {job} deleted with its {requests} requests", err=True)
