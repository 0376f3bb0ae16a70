"""`specq submit INPUT.jsonl [gen options] [--wait]`: store a job and queue it; its id alone on stdout."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

import click

from specq.cli.follow import Wait, cancelled_here, follow, note_missing_workers, polling, stopped_following
from specq.cli.group import cli
from specq.cli.options import (
    Duration,
    GenerationOptions,
    InputFile,
    broker_option,
    database_option,
    generation_options,
    input_limit_options,
    patient_reads,
    specq_errors,
)
from specq.cli.progress import counted

if TYPE_CHECKING:
    from specq.jobs.inputs import InputLimits
    from specq.jobs.status import JobStatus


METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits


def _metadata(pairs: tuple[str, ...]) -> dict[str, str]:
    """--metadata KEY=VALUE pairs as a dict; a usage error names the first bad one."""
    if len(pairs) > METADATA_PAIRS:
        raise click.BadParameter(f"{len(pairs)} pairs given, {METADATA_PAIRS} at most", param_hint="'--metadata'")
    found: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="'--metadata'")
        if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise click.BadParameter(
                f"{key!r}: keys are {METADATA_KEY_CHARS} characters at most, values {METADATA_VALUE_CHARS}",
                param_hint="'--metadata'",
            )
        if any(unicodedata.category(c) == "Cc" for c in pair):  # a newline forges a line of `status`,
            # an escape sequence drives the terminal that shows it
            raise click.BadParameter(f"{pair!r} holds a control character", param_hint="'--metadata'")
        if key in found:
            raise click.BadParameter(f"{key!r} is given twice", param_hint="'--metadata'")
        found[key] = value
    return found


WINDOW_CHARS = 16  # as stored with the job


def _window(value: str | None, param: click.Parameter, ctx: click.Context) -> tuple[str, timedelta] | None:
    """--completion-window as given (stored so) and as a span."""
    if value is None:
        return None
    if len(value) > WINDOW_CHARS:
        raise click.BadParameter(f"{value!r} is longer than {WINDOW_CHARS} characters; write it shorter, e.g. 24h")
    return value, Duration().convert(value, param, ctx)


@cli.command("submit")
@click.argument("input_path", metavar="INPUT.jsonl", type=InputFile())
@generation_options
@click.option(
    "--wait",
    is_flag=True,
    help="Show progress on stderr and return when the job ends: exit 0 when every request completed, 1 when any "
    "failed (or the job was cancelled or expired).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    help="With --wait and a broker: stop waiting after this many seconds (exit 1); the job keeps running.",
)
@click.option(
    "--metadata",
    "metadata_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    callback=lambda ctx, param, value: _metadata(value),
    help=f"A label stored with the job and shown by `specq status` (repeatable, {METADATA_PAIRS} at most; keys up to "
    f"{METADATA_KEY_CHARS} characters, values up to {METADATA_VALUE_CHARS}, as OpenAI Batch's metadata).",
)
@click.option(
    "--completion-window",
    type=str,
    callback=lambda ctx, param, value: _window(value, param, ctx),
    help="Requests not started within this span of the submit (e.g. 24h, 30m, 7d) expire, and so does the job "
    "(OpenAI Batch's completion_window). [default: none]",
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
    timeout: float | None,
    metadata_pairs: dict[str, str],
    completion_window: tuple[str, timedelta] | None,
    max_attempts: int,
    database_url: str | None,
    broker_url: str | None,
    generation: GenerationOptions,
    input_limits: InputLimits,
) -> None:
    """Validate the whole file (- for standard input, read once), store the job and enqueue it; print the job id.

    With no broker (no --broker-url, no SPECQ_BROKER_URL) the job runs here, in this process, through
    the workers' own code, and is stored in the database all the same; it is followed as --wait follows
    it (progress on stderr; exit 1 when a request failed or the job was cancelled).
    """
    if timeout is not None and not wait:
        raise click.UsageError("--timeout needs --wait")
    with specq_errors():
        from specq.jobs.services import broker_url as resolve_broker
        from specq.jobs.submit import JobSpec, submit_job

        broker = resolve_broker(broker_url)
        if timeout is not None and broker is None:
            raise click.UsageError(
                "--timeout needs a broker: with none the job runs in this process, which cannot leave it running"
            )
        spec = JobSpec(
            target=generation.target,
            draft=generation.draft,
            settings=generation.job_settings(max_attempts),
            chat_template=generation.chat_template,
            served_model_name=generation.served_model_name,
            metadata=metadata_pairs,
            completion_window=None if completion_window is None else completion_window[0],
            completion_window_s=None if completion_window is None else completion_window[1].total_seconds(),
        )
        submitted = submit_job(input_path, spec, database_url=database_url, broker=broker, limits=input_limits)
    click.echo(submitted.job_id)
    click.echo(
        f"job {submitted.job_id}: {counted(submitted.total, 'request')} in {counted(len(submitted.chunks), 'chunk')}"
        + (", running here (no broker)" if submitted.embedded else ", queued"),
        err=True,
    )
    if not wait and not submitted.embedded:
        return
    if submitted.embedded:
        from specq.worker.embedded import run_job_here

        def run_here(on_status: Callable[[JobStatus], None]) -> JobStatus:
            return run_job_here(
                submitted.db,
                submitted.job_id,
                submitted.chunks,
                generation.device,
                on_status,
                on_interrupt=lambda: cancelled_here(submitted.job_id),
            )

        waiting: Wait = run_here
    else:
        patient = patient_reads()
        note_missing_workers(submitted.db, patient)
        waiting = polling(submitted.db, submitted.job_id, patient, timeout)
    # run here, the job is followed in the foreground whether or not --wait was given: with its progress
    # and its exit code (a cancel from another shell included), as --wait would
    foreground = wait or submitted.embedded
    try:
        follow(submitted.job_id, submitted.total, waiting, show=foreground, timeout=timeout, strict=foreground)
    except KeyboardInterrupt:
        if submitted.embedded:  # cancelled, as `cancelled_here` said at the first Ctrl-C
            raise SystemExit(130) from None
        stopped_following(submitted.job_id)
