"""The Celery task. It only unpacks its JSON arguments and calls `worker.chunk.run_chunk`."""

from __future__ import annotations

import logging

from sqlalchemy.exc import InterfaceError, OperationalError

from specq.db.session import identity
from specq.queue import PROCESS_CHUNK_TASK
from specq.worker.app import app
from specq.worker.chunk import run_chunk_patiently
from specq.worker.runtime import get_context
from specq.worker.startup import EXIT_MODEL_UNLOADABLE

log = logging.getLogger(__name__)


# A database that is unreachable must not lose the chunk. The task first waits it out in place (the
# worker takes no other message meanwhile, so the queue is not churned through retries), then, past
# that patience, Celery retries it with backoff, up to about an hour more; the claims it held are
# given back by the heartbeat as soon as the database answers.
@app.task(
    name=PROCESS_CHUNK_TASK,
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=True,
    retry_backoff_max=300,
    max_retries=15,
)
def process_chunk(job_id: str, first: int, end: int, database: str | None = None) -> dict[str, int]:
    """Run the requests of job `job_id` at positions [first, end) that are still to do.

    `database`: the identity of the job's database (`db.session.identity`; absent from older messages).
    A worker pointed at another database would find no job there and drop the chunk as one deleted;
    instead it sets the message aside (`worker.serving.set_aside`) and goes on serving its own."""
    ctx = get_context()
    if database is not None and database != identity(ctx.db):
        from specq.worker.serving import set_aside

        set_aside(ctx, (job_id, first, end), database)
        return {"claimed": 0, "written": 0, "cancelled": 0, "released": 0}
    counts = run_chunk_patiently(ctx, job_id, first, end)
    log.info("job %s chunk [%d, %d): %s", job_id, first, end, counts)
    if ctx.shared.unusable:
        # the chunk went back to the queue; this worker takes no other: Celery's own warm shutdown,
        # with the exit code that tells the autoscaler why (`specq worker` prints the reason)
        from celery.worker import state

        ctx.shared.stopping.set()
        state.should_stop = EXIT_MODEL_UNLOADABLE
    return counts
