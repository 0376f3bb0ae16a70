"""`submit --wait`: poll the job's status until it ends, reporting each poll."""

from __future__ import annotations

import time
from collections.abc import Callable

from specq.db.session import Database
from specq.jobs.expiry import expire_due_jobs
from specq.jobs.patience import Patient
from specq.jobs.status import JobStatus, job_status


def wait_for_job(
    db: Database,
    job_id: str,
    on_update: Callable[[JobStatus], None],
    *,
    interval_s: float = 0.5,
    give_up: Callable[[], bool] = lambda: False,
    patient: Patient | None = None,
) -> JobStatus:
    """Poll every `interval_s` until the job ends (or `give_up()` says the work stopped); returns the
    last status. `patient`: each poll rides out a database outage through it (jobs.patience)."""
    while True:
        stopped = give_up()  # read before the status, so the last poll sees everything the work wrote

        def poll() -> JobStatus:
            expire_due_jobs(db, job_id)  # a job that no worker serves still ends on time
            return job_status(db, job_id)

        status = patient(poll) if patient else poll()
        on_update(status)
        if status.ended or stopped:
            return status
        time.sleep(interval_s)
