"""`specq status [JOB] [--json]`: one job's state, counts and metrics; without JOB, the recent jobs."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import click

from specq.cli.group import cli
from specq.cli.options import Duration, database_option, job_argument, patient_reads, specq_errors
from specq.db.states import JobState

JOB_STATES = tuple(str(state) for state in JobState)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return " ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in value) or "-"
    return "-" if value is None else str(value)


@cli.command("status")
@job_argument(required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON: one object for JOB, else a list, newest first.")
@click.option(
    "--limit", type=click.IntRange(1, 2**31 - 1), default=20, show_default=True, help="Recent jobs listed without JOB."
)
@click.option("--state", type=click.Choice(JOB_STATES), help="Without JOB: only the jobs in this state.")
@click.option(
    "--since", type=Duration(), help="Without JOB: only the jobs created in this last span, e.g. 30m, 1h, 7d."
)
@database_option
def status(
    job: str | None,
    as_json: bool,
    limit: int,
    state: str | None,
    since: timedelta | None,
    database_url: str | None,
) -> None:
    """Show a job's state, counts and metrics (tokens/s, acceptance rate, mean acceptance length,
    acceptance per position, token usage); without JOB, the recent jobs."""
    if job and (state or since):
        raise click.UsageError("--state and --since filter the job list: give them without JOB")
    with specq_errors():
        from specq.db.session import open_database
        from specq.jobs.status import job_status, recent_jobs

        patient = patient_reads()
        db = patient(lambda: open_database(database_url))
        found: dict[str, Any] | list[dict[str, Any]] = patient(
            lambda: job_status(db, job) if job else recent_jobs(db, limit, state=state, since=since)
        )
    if as_json:
        click.echo(json.dumps(found, indent=None if isinstance(found, list) else 2))
        return
    if isinstance(found, dict):
        width = max(len(k) for k in found)
        for key, value in found.items():
            if isinstance(value, dict) and all(not isinstance(v, dict) for v in value.values()):
                value = ", ".join(f"{k} {_fmt(v)}" for k, v in value.items()) or "-"
            click.echo(f"{key:<{width}}  {_fmt(value)}")
        return
    if not found:
        click.echo("no jobs yet", err=True)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "state", "done/total", "failed", "tok/s", "acceptance", "created", box=None)
    for j in found:
        table.add_row(
            j["id"],
            j["state"],
            f"{j['completed'] + j['failed']}/{j['total']}",
            str(j["failed"]),
            f"{j['tokens_per_second']:.1f}",
            f"{j['acceptance_rate']:.3f}",
            (j["created_at"] or "")[:19],
        )
    Console(soft_wrap=True).print(table)
