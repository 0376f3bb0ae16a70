"""`specq status [JOB] [--json]`: one job's state, counts and metrics; without JOB, the recent jobs."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import click

from specq.cli.group import cli
from specq.cli.options import Duration, database_option, job_argument, patient_reads, specq_errors
from specq.cli.progress import NOT_APPLICABLE, rate_text
from specq.cli.tables import aligned, print_table
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
        for line in _details(found):
            click.echo(line)
        return
    if not found:
        click.echo("no jobs yet", err=True)
        return
    rows = [
        [
            j["id"],
            j["state"],
            f"{j['completed'] + j['failed']}/{j['total']}",
            str(j["failed"]),
            f"{j['tokens_per_second']:.1f}",
            rate_text(j["acceptance_rate"] if j["num_draft_tokens"] else None),
            (j["created_at"] or "")[:19],
        ]
        for j in found
    ]
    columns = ["id", "state", "done/total", "failed", "tok/s", "acceptance", "created"]
    print_table(columns, rows, drop=("created", "tok/s", "failed", "acceptance"))


# shown as n/a where no draft token was proposed (target-only, or none yet): no rate, rather than a rate of 0
_ACCEPTANCE_FIGURES = ("acceptance_rate", "mean_acceptance_length")


def _details(found: dict[str, Any]) -> list[str]:
    """One job's status as `key  value` lines; acceptance by proposer as a table of the proposers that ran."""
    width = max(len(k) for k in found)
    lines = []
    for key, value in found.items():
        if key in _ACCEPTANCE_FIGURES and not found["num_draft_tokens"]:
            value = NOT_APPLICABLE
        elif key == "acceptance_by_proposer":
            ran = {name: counters for name, counters in value.items() if counters["drafts"]}
            if ran:
                lines.append(key)
                lines.extend(_by_proposer(ran))
                continue
            value = NOT_APPLICABLE
        elif isinstance(value, dict) and all(not isinstance(v, dict) for v in value.values()):
            value = ", ".join(f"{k} {_fmt(v)}" for k, v in value.items()) or "-"
        lines.append(f"{key:<{width}}  {_fmt(value)}")
    return lines


def _by_proposer(ran: dict[str, dict[str, Any]]) -> list[str]:
    rows = [
        [name, str(c["drafts"]), str(c["draft_tokens"]), str(c["accepted_tokens"]), f"{c['acceptance_rate']:.3f}"]
        for name, c in ran.items()
    ]
    return aligned(["proposer", "drafts", "draft tokens", "accepted tokens", "acceptance rate"], rows, indent="  ")
