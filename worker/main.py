"""`specq worker`: one Celery worker process bound to one device, until SIGTERM.

The pool is `solo`: tasks run in this very process, one at a time, so models are loaded once and CUDA
is never initialised before a fork (there is none), and the heartbeat thread and the Prometheus
endpoint see the same state as the task. A worker that dies is recovered from outside: its leases
expire and another worker's sweeper requeues them; Redis redelivers its unacknowledged task later.
"""

from __future__ import annotations

import logging

from db.session import open_database
from jobs.services import check_broker
from models.loading import resolve_device
from worker.chunk import WorkerContext
from worker.constants import CHUNK_QUEUE
from worker.heartbeat import Heartbeat, register_worker, unregister_worker
from worker.model_cache import ModelCache
from worker.runtime import set_context, worker_name
from worker.settings import QUEUE

log = logging.getLogger(__name__)


def run_worker(
    *,
    device: str | None,
    database_url: str | None,
    broker: str,
    metrics_port: int | None = None,
    models_cached: int = 1,
    loglevel: str = "INFO",
) -> None:
    """Serve chunk tasks until SIGTERM (Celery's warm shutdown: the running chunk finishes first)."""
    db = open_database(database_url)
    check_broker(broker)
    resolved = resolve_device(device)
    metrics = None
    if metrics_port is not None:
        from worker.metrics import WorkerMetrics

        metrics = WorkerMetrics.create()
        metrics.serve(metrics_port)
    ctx = WorkerContext(
        db=db,
        name=worker_name(resolved),
        device=resolved,
        models=ModelCache(models_cached),
        queue=QUEUE,
        metrics=metrics,
        registered=True,
    )
    set_context(ctx)
    register_worker(ctx)
    heartbeat = Heartbeat(ctx, broker)
    heartbeat.start()
    log.info("worker %s serving queue %s", ctx.name, CHUNK_QUEUE)

    from worker.app import configure
    from worker.tasks import process_chunk  # noqa: F401  (registers the task on the app)

    app = configure(broker)
    try:
        app.worker_main(
            [
                "worker",
                "--pool=solo",
                "--concurrency=1",
                f"--hostname={ctx.name}",
                f"--queues={CHUNK_QUEUE}",
                f"--loglevel={loglevel}",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ]
        )
    finally:
        heartbeat.stop()
        unregister_worker(ctx)
        set_context(None)
