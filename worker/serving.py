"""What this worker tells the broker about itself, and what it does with a message for another database.

A chunk message carries the identity of its job's database. One that names another database than this
worker's is set aside (`jobs.fleet_registry.dead_letter`) and acknowledged: giving it back to the queue
would hand it to the next worker of the same fleet, and the next, for ever. The job is not lost: its
requests stay queued in their own database, and a fleet that serves it enqueues them again.
"""

from __future__ import annotations

import logging
from typing import Any

from specq.db.session import identity
from specq.jobs.fleet_registry import Serving, broker_client, dead_letter, describe, publish, withdraw
from specq.queue import DEAD_LETTER_KEY, Chunk
from specq.worker.context import WorkerContext

log = logging.getLogger(__name__)


def serving_entry(ctx: WorkerContext) -> Serving:
    return Serving(ctx.config.name, ctx.config.device, identity(ctx.db), ctx.shared.dead_lettered)


def publish_serving(ctx: WorkerContext, client: Any) -> None:
    """Write this worker's entry, live until `live_after` passes without another heartbeat."""
    publish(client, serving_entry(ctx), ctx.config.queue.live_after)


def withdraw_serving(ctx: WorkerContext) -> None:
    """Remove this stopping worker's entry; best effort (it expires anyway)."""
    import redis

    assert ctx.config.broker is not None
    client = broker_client(ctx.config.broker)
    try:
        withdraw(client, ctx.config.name)
    except redis.RedisError as exc:
        log.debug("could not remove this worker's entry from the broker (%s); it expires", exc)
    finally:
        client.close()


def set_aside(ctx: WorkerContext, chunk: Chunk, database: str) -> None:
    """Dead-letter a chunk message that names `database`, which this worker does not serve; count it
    (metrics, and this worker's entry at once, so `specq workers` shows it now) and say so in one line."""
    import redis

    assert ctx.config.broker is not None
    job_id, first, end = chunk
    client = broker_client(ctx.config.broker)
    try:
        total = dead_letter(client, chunk, database, ctx.config.name)
    except redis.RedisError as exc:
        # acknowledged all the same: the requests stay queued in their database, for its own fleet
        log.warning("job %s chunk [%d, %d) is in %s: could not set it aside (%s)", job_id, first, end, database, exc)
        client.close()
        return
    ctx.shared.dead_lettered += 1
    if ctx.metrics is not None:
        ctx.metrics.dead_lettered.labels(ctx.config.device).inc()
    try:
        publish_serving(ctx, client)
    except redis.RedisError as exc:
        log.debug("could not refresh this worker's entry (%s); the next heartbeat does", exc)
    finally:
        client.close()
    log.warning(
        "job %s chunk [%d, %d) is in %s, not in this worker's %s: set aside in %s (%d so far); "
        "a worker on that database runs it",
        job_id,
        first,
        end,
        describe(database),
        describe(identity(ctx.db)),
        DEAD_LETTER_KEY,
        total,
    )
