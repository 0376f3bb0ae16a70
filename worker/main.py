"""`specq worker`: one Celery worker process bound to one device, until SIGTERM.

The pool is `solo`: tasks run in this very process, one at a time, so models are loaded once and CUDA
is never initialised before a fork (there is none), and the heartbeat thread and the Prometheus
endpoint see the same state as the task. A worker that dies is recovered from outside: its leases
expire and another worker's sweeper requeues them; Redis redelivers its unacknowledged task later.

SIGTERM is Celery's warm shutdown: it takes no new task, and the chunk in hand stops feeding the
engine, finishes the batch in hand and gives the rest back to the queue (`worker.chunk`), so a stop
takes one batch's time, not one chunk's.
"""

from __future__ import annotations

import logging
import os
import sys

from specq.db.migrate import open_migrated
from specq.errors import WorkerUnusableError
from specq.jobs.services import check_broker
from specq.masking import mask_url
from specq.models.loading import resolve_device
from specq.queue import CHUNK_QUEUE, QueueSettings
from specq.worker.context import WorkerContext
from specq.worker.heartbeat import Heartbeat, register_worker, unregister_worker
from specq.worker.model_cache import ModelCache
from specq.worker.runtime import set_context, worker_name
from specq.worker.serving import publish_serving, withdraw_serving
from specq.worker.startup import EXIT_MODEL_UNLOADABLE, check_device

# a file the heartbeat thread touches every heartbeat_s, database up or not: Kubernetes' liveness probe
# checks its age, so a worker whose heartbeat thread stopped (its leases then expire) is restarted
ALIVE_FILE_ENV = "SPECQ_ALIVE_FILE"

log = logging.getLogger(__name__)


def announce(ctx: WorkerContext, broker: str) -> None:
    """Publish the database this worker serves before it consumes anything, so a client on another
    database hears of it at its next submit; the count of messages set aside starts at 0 on its page."""
    import redis

    from specq.jobs.fleet_registry import broker_client
    from specq.jobs.services import broker_unavailable

    client = broker_client(broker)
    try:
        publish_serving(ctx, client)
    except redis.RedisError as exc:
        raise broker_unavailable(broker, exc) from None
    finally:
        client.close()
    if ctx.metrics is not None:
        ctx.metrics.dead_lettered.labels(ctx.config.device)


def say_once_if_root(euid: int | None = None) -> bool:
    """Celery warns a worker run as root in seven lines (its SecurityWarning, which names a `--uid`
    option specq's worker does not have); specq says it in one, and silences Celery's. The image runs as
    its own user: nothing is said there. `euid`: injectable for tests; whether it said it."""
    if euid is None:
        euid = os.geteuid() if hasattr(os, "geteuid") else -1
    if euid != 0:
        return False
    import warnings

    from celery.exceptions import SecurityWarning

    warnings.filterwarnings("ignore", category=SecurityWarning)
    log.warning("the worker runs as root; it needs no privileges (run it as another user)")
    return True


def run_worker(
    *,
    device: str | None,
    database_url: str | None,
    broker: str,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
    models_cached: int = 1,
    compile: str = "auto",
    loglevel: str = "INFO",
) -> None:
    """Serve chunk tasks until SIGTERM (warm shutdown: the batch in hand finishes, the rest goes back).

    Raises WorkerUnusableError before consuming anything when the device is unusable (exit 3), and after
    giving its chunk back when a job's models do not load here (exit 4). `metrics_port` None: no metrics.
    """
    from specq.masking import register_urls

    logging.getLogger().setLevel(loglevel)  # as Celery sets it once it runs: the start-up lines show too
    register_urls(database_url, broker)
    resolved = resolve_device(device)
    check_device(resolved)  # before anything is registered or consumed: a worker that cannot serve takes nothing
    db = open_migrated(database_url)
    check_broker(broker)
    queue = QueueSettings.from_env()
    metrics = None
    if metrics_port is not None:
        from specq.worker.fleet_metrics import FleetCollector
        from specq.worker.metrics import WorkerMetrics

        metrics = WorkerMetrics.create(fleet=FleetCollector(db, queue.live_after))
        metrics.serve(metrics_port, metrics_host)
    ctx = WorkerContext(
        db=db,
        name=worker_name(resolved),
        device=resolved,
        models=ModelCache(models_cached, compile),
        queue=queue,
        metrics=metrics,
        registered=True,
        broker=broker,
    )
    set_context(ctx)
    announce(ctx, broker)
    register_worker(ctx)
    # the patched transport is installed before the heartbeat's sweeper may send its first task
    from celery import signals

    from specq.worker.app import configure
    from specq.worker.tasks import process_chunk  # noqa: F401  (registers the task on the app)

    heartbeat = Heartbeat(ctx, broker, alive_file=os.environ.get(ALIVE_FILE_ENV) or None)
    heartbeat.start()
    log.info("worker %s serving queue %s of %s; results in %s", ctx.config.name, CHUNK_QUEUE, mask_url(broker), db.url)

    def on_shutdown(**_kwargs: object) -> None:
        # runs in the signal handler: only set a flag; the chunk in hand reads it between requests
        ctx.shared.stopping.set()

    signals.worker_shutting_down.connect(on_shutdown, weak=False)
    app = configure(broker)
    # a worker outlives a broker outage of any length, reconnecting; commands that only send (submit,
    # retry) keep the short default and fail with a sentence instead
    app.conf.broker_connection_max_retries = None
    say_once_if_root()
    try:
        app.worker_main(
            [
                "--quiet",  # no banner: it is printed, not logged, and shows URLs in Celery's own mask
                "worker",
                "--pool=solo",
                "--concurrency=1",
                f"--hostname={ctx.config.name}",
                f"--queues={CHUNK_QUEUE}",
                f"--loglevel={loglevel}",
                # remote control (celery inspect) and events (Flower) are on in the app's configuration;
                # worker heartbeats are events too, so Flower sees the worker online. Gossip and mingle
                # only sync revoked task ids and clocks between workers, which specq does not use
                "--without-gossip",
                "--without-mingle",
            ]
        )
    except SystemExit as exc:
        if not ctx.shared.unusable and exc.code not in (None, 0):
            raise
    finally:
        heartbeat.stop()
        unregister_worker(ctx)
        withdraw_serving(ctx)
        set_context(None)
        # Celery sends stdout and stderr to its logger while it runs: the closing line is printed plainly
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    if ctx.shared.unusable:
        raise WorkerUnusableError(f"{ctx.shared.unusable}; gave its work back", EXIT_MODEL_UNLOADABLE)
