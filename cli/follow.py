"""Following a job to its end, as `submit --wait` and `specq wait` do: progress on stderr, a last line that
sums the job up, and the exit code (0: every request completed; 1: any failed, or the job was cancelled
or expired, or the wait gave up at its timeout and left the job running)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import click

from specq.cli.options import specq_errors
from specq.cli.progress import ProgressBar, acceptance_summary
from specq.db.states import JobState

if TYPE_CHECKING:
    from specq.db.session import Database
    from specq.jobs.patience import Patient
    from specq.jobs.status import JobStatus

# runs or polls the job, reporting each status; returns the last
Wait = Callable[[Callable[["JobStatus"], None]], "JobStatus"]


def summary(status: JobStatus) -> None:
    click.echo(
        f"job {status.id} {status.state}: {status.completed} completed, {status.failed} failed "
        f"of {status.total}; {status.generated_tokens} tokens at {status.tokens_per_second:.1f}/s, "
        + acceptance_summary(status.num_draft_tokens, status.acceptance_rate, status.mean_acceptance_length),
        err=True,
    )


def stopped_following(job_id: str) -> NoReturn:
    """Ctrl-C while following a job that workers run: this process leaves, the job does not (exit 130)."""
    click.echo(
        f"stopped following; job {job_id} goes on in the fleet: `specq wait {job_id}` follows it again", err=True
    )
    raise SystemExit(130)


def cancelled_here(job_id: str) -> None:
    """Said at the first Ctrl-C of a job run in this process: its work cannot outlive it, so it is cancelled."""
    click.echo(
        f"cancelled job {job_id} here (it ran in this process); the step under way ends, then specq exits; "
        f"`specq retry {job_id}` resumes it",
        err=True,
    )


def training_note(status: JobStatus) -> str:
    """`training the draft head (Ns of BUDGET)` while a `--draft train:N` job trains its head, else ''."""
    training = status.draft_training
    if not training or training.get("state") != "training":
        return ""
    return f"training the draft head ({training.get('training_s', 0.0):.0f}s of {training.get('budget')})"


def note_missing_workers(db: Database, patient: Patient) -> None:
    """One line on stderr when no worker is live: the job waits until one starts (by hand or an autoscaler)."""
    from specq.jobs.status import live_workers

    with specq_errors():
        workers = patient(lambda: live_workers(db))
    if not workers:
        click.echo(
            "no worker is live yet: the job waits for one; an autoscaler (`specq autoscale`), if one runs, starts "
            "one, else start one with `specq worker`",
            err=True,
        )


def polling(db: Database, job_id: str, patient: Patient, timeout: float | None) -> Wait:
    """The wait of a job that workers run: poll its status, riding out database outages, until it ends or
    `timeout` seconds pass."""
    from specq.jobs.wait import wait_for_job

    def wait(on_status: Callable[[JobStatus], None]) -> JobStatus:
        deadline = None if timeout is None else time.monotonic() + timeout
        give_up = (lambda: False) if deadline is None else (lambda: time.monotonic() >= deadline)
        return wait_for_job(db, job_id, on_status, give_up=give_up, patient=patient)

    return wait


def follow(job_id: str, total: int, wait: Wait, *, show: bool, timeout: float | None, strict: bool = True) -> None:
    """Run `wait` with a progress bar (`show`), then print the summary line; exit 1 when the wait gave up
    at `timeout`, and, when `strict`, when any request did not complete."""
    progress = ProgressBar(f"job {job_id}", total, show=show)

    def on_status(status: JobStatus) -> None:
        progress.update(status.done, status.tokens_per_second, status.acceptance, status.failed, training_note(status))

    with specq_errors(), progress:
        status = wait(on_status)
    summary(status)
    if not status.ended:
        raise click.ClickException(
            f"gave up waiting after {timeout:g}s: job {job_id} is {status.state} and keeps running "
            f"(`specq wait {job_id}` follows it again)"
        )
    if strict and (status.state != JobState.COMPLETED or status.failed):
        raise click.ClickException(
            f"job {job_id} {status.state}: {status.failed} of {status.total} requests failed"
            + (f", {status.remaining} did not run" if status.remaining else "")
        )
