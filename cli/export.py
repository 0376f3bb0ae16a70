"""`specq export JOB -o FILE [--format csv|jsonl|openai]`: stream a job's results to a file."""

from __future__ import annotations

import click

from specq.cli.group import cli
from specq.cli.options import database_option, job_argument, patient_reads, specq_errors

FORMATS = ("csv", "jsonl", "openai")


@cli.command("export")
@job_argument()
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="File to write ('-': stdout).")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    help="csv, jsonl (as `specq run` writes) or openai (Batch API output). "
    "[default: jsonl for *.jsonl and *.json, else csv]",
)
@click.option(
    "--csv-raw",
    is_flag=True,
    help="CSV: keep every cell exactly (RFC 4180 round trip). By default a text cell that begins with =, +, -, @, "
    "a tab or a carriage return gets a leading ' so spreadsheets show it instead of running it as a formula.",
)
@click.option("--completed-only", is_flag=True, help="Only the requests that completed (OpenAI's output file).")
@click.option(
    "--errors-only",
    is_flag=True,
    help="Only the requests that did not complete: failed, cancelled, expired, not run yet (OpenAI's error file).",
)
@database_option
def export(
    job: str,
    output: str,
    fmt: str | None,
    csv_raw: bool,
    completed_only: bool,
    errors_only: bool,
    database_url: str | None,
) -> None:
    """Write the job's results, one per request in input order, to FILE.

    A FIFO, a device or /dev/stdout is written through; a file (or a link's target) is replaced whole
    once complete."""
    if completed_only and errors_only:
        raise click.UsageError("--completed-only and --errors-only exclude each other; give one")
    only = "completed" if completed_only else "errors" if errors_only else None
    if fmt is None:
        fmt = "jsonl" if output.endswith((".jsonl", ".json")) else "csv"
    with specq_errors():
        from specq.db.session import open_database
        from specq.jobs.export import export_job

        patient = patient_reads()
        db = patient(lambda: open_database(database_url))
        count = export_job(db, job, output, fmt, csv_raw=csv_raw, only=only, patient=patient)  # type: ignore[arg-type]
    click.echo(f"wrote {count} results of job {job} to {output} ({fmt})", err=True)
