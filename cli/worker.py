"""`specq worker [--device cuda:0|cpu]` and `specq workers [--json]`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from specq.cli.group import cli
from specq.cli.options import broker_option, compile_option, database_option, patient_reads, specq_errors

if TYPE_CHECKING:
    from specq.jobs.status import WorkerStatus

DEFAULT_METRICS_PORT = 9100  # node_exporter's port too: a GPU host running both sets --metrics-port


@cli.command("worker")
@click.option(
    "--device", help="Torch device this worker is bound to, e.g. cuda:0 or cpu. [default: cuda:0 if available]"
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_METRICS_PORT,
    envvar="SPECQ_METRICS_PORT",
    help="Serve Prometheus metrics on this port (0: none). A port already taken is logged and skipped. "
    f"[env: SPECQ_METRICS_PORT; default: {DEFAULT_METRICS_PORT}]",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    envvar="SPECQ_METRICS_HOST",
    help="Address the metrics page listens on; 0.0.0.0 in a container, for Prometheus to reach it. "
    "[env: SPECQ_METRICS_HOST; default: 127.0.0.1]",
)
@compile_option(
    "auto",
    "Compiled forwards for jobs submitted with --compile auto: auto compiles on CUDA (with CUDA graphs), and "
    "on a CPU where a compile on this machine measured the model faster; on: where a job's models cannot be "
    "compiled here, the worker gives its chunk back and exits 4; off never compiles.",
)
@click.option(
    "--models-cached", type=click.IntRange(min=1), default=1, show_default=True, help="Model pairs kept loaded."
)
@click.option(
    "--pull-models/--no-pull-models",
    default=True,
    envvar="SPECQ_PULL_MODELS",
    help="A job naming a catalogue model (`specq models`) this host lacks: fetch it first, or give the work "
    "back and exit 4 with a line naming `specq models pull NAME`. [env: SPECQ_PULL_MODELS; default: pull]",
)
@database_option
@broker_option
@click.pass_context
def worker(
    ctx: click.Context,
    device: str | None,
    metrics_port: int,
    metrics_host: str,
    models_cached: int,
    pull_models: bool,
    compile: str,
    database_url: str | None,
    broker_url: str | None,
) -> None:
    """Run one Celery worker bound to one device until SIGTERM (the batch in hand finishes first; the
    rest of its chunk goes back to the queue).

    Exits 3 at once when the device is unusable here, and 4 when a job's models do not load here, or do
    not compile under its own --compile on (its chunk goes back to the queue first): a misconfigured
    worker never fails a request. A job submitted with --compile on whose models cannot be compiled fails
    its requests with the reason: that is the job's setting, not the worker's."""
    from specq.jobs.services import broker_url as resolve_broker

    with specq_errors():
        broker = resolve_broker(broker_url)
    if broker is None:
        raise click.UsageError("a worker needs a broker: give --broker-url or set SPECQ_BROKER_URL")
    verbose = (ctx.find_root().params.get("verbose") or 0) if ctx.find_root() else 0
    from specq.models.catalogue import allow_pulls

    allow_pulls(pull_models)  # the chunks run in this very process (a solo pool)
    with specq_errors():
        from specq.worker.main import run_worker

        run_worker(
            device=device,
            database_url=database_url,
            broker=broker,
            metrics_port=metrics_port or None,
            metrics_host=metrics_host,
            models_cached=models_cached,
            compile=compile,
            loglevel="DEBUG" if verbose >= 2 else "INFO",
        )


@cli.command("workers")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of the workers.")
@click.option("--all", "include_gone", is_flag=True, help="Also list stopped workers and lost ones (no heartbeat).")
@database_option
@broker_option
def workers(as_json: bool, include_gone: bool, database_url: str | None, broker_url: str | None) -> None:
    """List the live workers: name, device, state, last heartbeat, current batch; with a broker, also the
    chunk messages each set aside because they named another database (and how many in all)."""
    with specq_errors():
        from specq.db.session import open_database
        from specq.jobs.fleet_registry import FleetView, read_fleet
        from specq.jobs.services import broker_url as resolve_broker
        from specq.jobs.status import live_workers

        broker = resolve_broker(broker_url)
        patient = patient_reads()
        db = patient(lambda: open_database(database_url))
        found = patient(lambda: live_workers(db, include_gone=include_gone))
    # the broker's part is extra: with Redis down (or none) this stays the database's view
    fleet: FleetView | None = read_fleet(broker) if broker is not None else None

    def set_aside(name: str) -> int | None:
        if fleet is None:
            return None
        entry = fleet.entries.get(name)
        return entry.dead_lettered if entry is not None else 0

    if as_json:
        click.echo(json.dumps([{**w.to_json(), "dead_lettered": set_aside(w.name)} for w in found]))
        return
    if not found:
        click.echo("no live workers", err=True)
    else:
        _print_workers(found, set_aside)
    if fleet is not None and fleet.dead_lettered:
        from specq.cli.progress import counted
        from specq.queue import DEAD_LETTER_KEY

        click.echo(
            f"{counted(fleet.dead_lettered, 'chunk message')} named another database than the workers' and "
            f"{'was' if fleet.dead_lettered == 1 else 'were'} set aside unrun (the latest in {DEAD_LETTER_KEY}; "
            "docs/fleet.md says what to do)",
            err=True,
        )


def _print_workers(found: list[WorkerStatus], set_aside: Callable[[str], int | None]) -> None:
    from specq.cli.tables import print_table
    from specq.jobs.status import compile_summary

    rows = [
        [
            w.name,
            w.device,
            f"loading {w.loading}" if w.loading else w.state,
            (w.last_heartbeat or "")[:19],
            f"{w.heartbeat_age_s:.0f}s",
            f"{w.current_batch} (job {w.current_job})" if w.current_batch else "-",
            compile_summary(w.compiled),
            "-" if set_aside(w.name) is None else str(set_aside(w.name)),
        ]
        for w in found
    ]
    columns = ["name", "device", "state", "last heartbeat", "age", "current batch", "compiled", "set aside"]
    print_table(columns, rows, drop=("set aside", "compiled", "last heartbeat", "current batch", "age", "device"))
