"""`specq autoscale --min N --max M [--devices ...] [--cooldown S] [--interval S]`: local workers sized
to the backlog, until SIGTERM."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import click

from specq.cli.group import cli
from specq.cli.options import broker_option, database_option, specq_errors


@cli.command("autoscale")
@click.option(
    "--min",
    "min_workers",
    type=click.IntRange(min=0),
    required=True,
    help="Workers kept running (0: scale to zero when idle).",
)
@click.option("--max", "max_workers", type=click.IntRange(min=1), required=True, help="Most workers running at once.")
@click.option(
    "--devices",
    envvar="SPECQ_AUTOSCALE_DEVICES",
    help="Comma-separated devices the workers are placed on, round-robin, e.g. cuda:0,cuda:1 or cpu. "
    "[env: SPECQ_AUTOSCALE_DEVICES; default: every visible GPU, else cpu]",
)
@click.option(
    "--cooldown",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds the backlog must stay low before a worker is stopped.",
)
@click.option(
    "--interval",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds between backlog reads.",
)
@click.option(
    "--backlog-per-worker",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Requests (queued plus running) one worker is sized for.",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0, min_open=True),
    default=300.0,
    show_default=True,
    help="Seconds a stopping worker gets to finish its batch before it is killed.",
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write each worker's log to its own file here. [default: this command's stderr]",
)
@click.option(
    "--give-up-after",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Failed worker starts in a row (exit 3 or 4, or within seconds) after which a device gets no "
    "more workers, until this command restarts.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=9100,
    show_default=True,
    help="Worker i of the fleet serves Prometheus metrics on this port + i, i < --max (0: none).",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="Address the workers' metrics pages listen on; 0.0.0.0 in a container.",
)
@database_option
@broker_option
@click.pass_context
def autoscale(
    ctx: click.Context,
    min_workers: int,
    max_workers: int,
    devices: str | None,
    cooldown: float,
    interval: float,
    backlog_per_worker: int,
    grace: float,
    log_dir: Path | None,
    give_up_after: int,
    metrics_port: int,
    metrics_host: str,
    database_url: str | None,
    broker_url: str | None,
) -> None:
    """Keep between --min and --max local workers running, sized to the backlog, until SIGTERM.

    The backlog (requests queued plus running) is read from the database every --interval seconds.
    Workers start at once when it grows, and stop (gracefully: the batch in hand finishes, the rest goes
    back to the queue) only once it has stayed low for --cooldown seconds. Every decision is logged on
    one line. On SIGTERM every worker is stopped and none is left behind.
    """
    from specq.jobs.services import broker_url as resolve_broker
    from specq.worker.autoscale.config import AutoscaleConfig, default_devices, parse_devices

    with specq_errors():
        broker = resolve_broker(broker_url)
    if broker is None:
        raise click.UsageError("autoscale needs a broker: give --broker-url or set SPECQ_BROKER_URL")
    placed = parse_devices(devices) if devices is not None else default_devices()
    try:
        config = AutoscaleConfig(
            min_workers=min_workers,
            max_workers=max_workers,
            devices=placed,
            backlog_per_worker=backlog_per_worker,
            cooldown_s=cooldown,
            interval_s=interval,
            grace_s=grace,
            give_up_after=give_up_after,
            metrics_port=metrics_port or None,
            metrics_host=metrics_host,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    verbose = ctx.find_root().params.get("verbose") or 0
    # the decisions are what this command is for: shown without -v
    logging.getLogger("specq.worker.autoscale").setLevel(logging.DEBUG if verbose >= 2 else logging.INFO)
    with specq_errors():
        from specq.worker.autoscale.loop import run_autoscaler

        run_autoscaler(config, database_url=database_url, broker=broker, env=os.environ, log_dir=log_dir)
