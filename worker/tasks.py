"""The Celery task. It only unpacks its JSON arguments and calls `worker.chunk.run_chunk`."""

from __future__ import annotations

import logging

from sqlalchemy.exc import OperationalError

from worker.app import app
from worker.chunk import run_chunk
from worker.constants import PROCESS_CHUNK_TASK
from worker.runtime import get_context

log = logging.getLogger(__name__)


# A database that is briefly unreachable must not lose the chunk: the task is retried, with backoff, up
# to about an hour; requests it had claimed come back through their expired leases meanwhile.
@app.task(
    name=PROCESS_CHUNK_TASK,
    autoretry_for=(OperationalError,),
    retry_backoff=True,
    retry_backoff_max=300,
    max_retries=15,
)
def process_chunk(job_id: str, first: int, end: int) -> dict[str, int]:
    """Run the requests of job `job_id` at positions [first, end) that are still to do."""
    counts = run_chunk(get_context(), job_id, first, end)
    log.info("job %s chunk [%d, %d): %s", job_id, first, end, counts)
    return counts
