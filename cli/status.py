"""`specq status [JOB] [--json]`: one job's state, counts and metrics; without JOB, the recent jobs."""

from __future__ import annotations

import json
import unicodedata
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import click

from specq.cli.group import cli
from specq.cli.options import Duration, database_option, job_argument, patient_reads, specq_errors
from specq.cli.progress import NOT_APPLICABLE, rate_text
from specq.cli.tables import aligned, print_table
from specq.db.states import JobState

if TYPE_CHECKING:
    from specq.jobs.status import JobStatus, ProposerAcceptance

JOB_STATES = tuple(str(state) for state in JobState)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return " ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in value) or "-"
    return "-" if value is None else _escaped(str(value))


def _escaped(text: str) -> str:
    """`text` with each control character written as its escape (`\\n`, `\\x1b`): a string a user stored
    (metadata, the input's name) must not drive the terminal or forge a line of the output."""
    return "".join(c.encode("unicode_escape").decode() if unicodedata.category(c) == "Cc" else c for c in text)


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
        found: JobStatus | list[JobStatus] = patient(
            lambda: job_status(db, job) if job else recent_jobs(db, limit, state=state, since=since)
        )
    if isinstance(found, list):
        _list(found, as_json)
    elif as_json:
        click.echo(json.dumps(found.to_json(), indent=2))
    else:
        for line in _details(found):
            click.echo(line)


def _list(found: list[JobStatus], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps([j.to_json() for j in found]))
        return
    if not found:
        click.echo("no jobs yet", err=True)
        return
    rows = [
        [
            j.id,
            j.state,
            f"{j.done}/{j.total}",
            str(j.failed),
            f"{j.tokens_per_second:.1f}",
            rate_text(j.acceptance),
            (j.created_at or "")[:19],
        ]
        for j in found
    ]
    columns = ["id", "state", "done/total", "failed", "tok/s", "acceptance", "created"]
    print_table(columns, rows, drop=("created", "tok/s", "failed", "acceptance"))


def _details(found: JobStatus) -> list[str]:
    """One job's status as `key  value` lines, in its JSON form's order; the acceptance figures n/a where
    no draft token was proposed (no rate, rather than a rate of 0)."""
    shown: dict[str, Any] = found.to_json()
    if found.acceptance is None:
        shown.update(
            acceptance_rate=NOT_APPLICABLE,
            mean_acceptance_length=NOT_APPLICABLE,
            acceptance_per_position=NOT_APPLICABLE,
        )
    ran = {name: counters for name, counters in found.acceptance_by_proposer.items() if counters.drafts}
    width = max(len(k) for k in shown)
    lines = []
    for key, value in shown.items():
        if key == "acceptance_by_proposer":  # a table under its name, of the proposers that ran
            if ran:
                lines.append(key)
                lines.extend(_by_proposer(ran))
                continue
            value = NOT_APPLICABLE
        elif isinstance(value, dict) and all(not isinstance(v, dict) for v in value.values()):
            value = ", ".join(f"{k} {_fmt(v)}" for k, v in value.items()) or "-"
        lines.append(f"{key:<{width}}  {_fmt(value)}")
    return lines


def _by_proposer(ran: dict[str, ProposerAcceptance]) -> list[str]:
    rows = [
        [name, str(c.drafts), str(c.draft_tokens), str(c.accepted_tokens), f"{c.acceptance_rate:.3f}"]
        for name, c in ran.items()
    ]
    return aligned(["proposer", "drafts", "draft tokens", "accepted tokens", "acceptance rate"], rows, indent="  ")
