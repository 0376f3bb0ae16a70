"""Sending chunk tasks to the broker by name: (job_id, first, end) each, JSON, over one pooled connection."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from specq.jobs.services import broker_unavailable
from specq.queue import PROCESS_CHUNK_TASK, Chunk, celery_app

log = logging.getLogger(__name__)


def job_chunks(job_id: str, total: int, chunk_size: int) -> Iterable[Chunk]:
    """The chunks of a job of `total` requests: positions [first, end), in file order."""
    for first in range(0, total, chunk_size):
        yield job_id, first, min(first + chunk_size, total)


def enqueue_chunks(broker: str, chunks: Iterable[Chunk], database: str | None = None) -> int:
    """Send one `process_chunk` task per chunk; returns how many. Raises ServiceUnavailableError.
    `database`: the identity of the database the job is in (`db.session.identity`), which a worker
    checks against its own before it runs the chunk."""
    from kombu.exceptions import KombuError, OperationalError

    app = celery_app(broker)
    sent = 0
    try:
        with app.producer_or_acquire() as producer:
            for job_id, first, end in chunks:
                extra = {} if database is None else {"database": database}
                app.send_task(PROCESS_CHUNK_TASK, args=(job_id, first, end), kwargs=extra, producer=producer)
                sent += 1
    except (OperationalError, KombuError, OSError) as exc:
        raise broker_unavailable(broker, exc) from None
    log.debug("enqueued %d chunk tasks", sent)
    return sent
