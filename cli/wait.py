"""`specq wait JOB [--timeout S]`: follow a job to its end, as `submit --wait` does (after a `retry`, or a
`submit` without --wait)."""

from __future__ import annotations

import click

from specq.cli.follow import follow, note_missing_workers, polling, stopped_following
from specq.cli.group import cli
from specq.cli.options import database_option, job_argument, patient_reads, specq_errors


@cli.command("wait")
@job_argument()
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    help="Stop waiting after this many seconds (exit 1); the job keeps running.",
)
@database_option
def wait(job: str, timeout: float | None, database_url: str | None) -> None:
    """Show the job's progress on stderr until it ends: exit 0 when every request completed, 1 when any
    failed, the job was cancelled or expired, or --timeout passed first (the job keeps running)."""
    with specq_errors():
        from specq.db.session import open_database
        from specq.jobs.status import job_status

        patient = patient_reads()
        db = patient(lambda: open_database(database_url))
        status = patient(lambda: job_status(db, job))
    try:
        if not status.ended:
            note_missing_workers(db, patient)
        follow(job, status.total, polling(db, job, patient, timeout), show=True, timeout=timeout)
    except KeyboardInterrupt:
        stopped_following(job)
