"""The embedded mode: with no broker, chunks run in this process, through the workers' own task code."""

from __future__ import annotations

from collections.abc import Iterable

from specq.db.session import Database


def run_chunks_here(db: Database, chunks: Iterable[tuple[str, int, int]], device: str | None) -> None:
    """Run the chunks one after another in this process, exactly as a worker would run their tasks."""
    from specq.models.loading import resolve_device
    from specq.worker.context import WorkerContext
    from specq.worker.heartbeat import Heartbeat
    from specq.worker.runtime import get_context_or_none, set_context, worker_name
    from specq.worker.tasks import process_chunk

    previous = get_context_or_none()
    resolved = resolve_device(device)
    ctx = WorkerContext(db=db, name=worker_name(resolved, "embedded"), device=resolved)
    set_context(ctx)
    heartbeat = Heartbeat(ctx, broker=None)  # renews this process's leases; there is no queue to sweep
    heartbeat.start()
    try:
        for job_id, first, end in chunks:
            process_chunk(job_id, first, end)  # the Celery task, called directly: it runs here and now
    finally:
        heartbeat.stop()
        set_context(previous)
