"""The embedded mode: with no broker, chunks run in this process, through the workers' own task code."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from specq.db.session import Database
from specq.queue import Chunk
from specq.worker.context import SharedState

if TYPE_CHECKING:
    from specq.jobs.status import JobStatus


def run_chunks_here(
    db: Database, chunks: Iterable[Chunk], device: str | None, shared: SharedState | None = None
) -> None:
    """Run the chunks one after another in this process, exactly as a worker would run their tasks.

    `shared.stopping`, once set, ends the run as SIGTERM ends a worker's: the batch in hand finishes."""
    from specq.models.loading import resolve_device
    from specq.worker.context import WorkerContext
    from specq.worker.heartbeat import Heartbeat
    from specq.worker.runtime import get_context_or_none, set_context, worker_name
    from specq.worker.tasks import process_chunk

    previous = get_context_or_none()
    resolved = resolve_device(device)
    ctx = WorkerContext(db=db, name=worker_name(resolved, "embedded"), device=resolved)
    if shared is not None:
        ctx.shared = shared
    set_context(ctx)
    heartbeat = Heartbeat(ctx, broker=None)  # renews this process's leases; there is no queue to sweep
    heartbeat.start()
    try:
        for job_id, first, end in chunks:
            process_chunk(job_id, first, end)  # the Celery task, called directly: it runs here and now
    finally:
        heartbeat.stop()
        set_context(previous)


def run_job_here(
    db: Database,
    job_id: str,
    chunks: Iterable[Chunk],
    device: str | None,
    on_status: Callable[[JobStatus], None],
    on_interrupt: Callable[[], None] = lambda: None,
) -> JobStatus:
    """Run a submitted job's chunks in a thread of this process (`run_chunks_here`) and wait until the job
    ends, passing each status read to `on_status`; return the last status.

    The work dies with this process, so an interrupt (KeyboardInterrupt, Ctrl-C) cancels the job in the
    store, calls `on_interrupt` (to say so at once), lets the batch in hand finish (a thread torn down inside a
    torch kernel at exit aborts the process) and propagates; a second interrupt leaves at once. An error
    that stops the work is raised as a SpecqError naming the job."""
    import threading

    from specq.errors import SpecqError
    from specq.jobs.control import cancel_job
    from specq.jobs.wait import wait_for_job

    failure: list[BaseException] = []
    shared = SharedState()

    def work() -> None:
        try:
            run_chunks_here(db, chunks, device, shared)
        except BaseException as exc:  # raised again by the waiting thread
            failure.append(exc)

    worker = threading.Thread(target=work, name="specq-embedded", daemon=True)
    worker.start()
    try:
        status = wait_for_job(db, job_id, on_status, give_up=lambda: not worker.is_alive())
    except KeyboardInterrupt:
        cancel_job(db, job_id)
        shared.stopping.set()
        on_interrupt()
        try:
            worker.join()
        except KeyboardInterrupt:
            os._exit(130)  # asked twice: no clean-up, and so no abort from the thread still in a kernel
        raise
    # the job's end is stored before the thread is done (its batch closed, its models released): a
    # process that exits with the thread still inside torch aborts ("terminate called ...")
    worker.join()
    if failure:
        raise SpecqError(f"job {job_id} stopped: {failure[0]}") from failure[0]
    return status
