"""The fleet's gauges, read from the database at scrape time: the backlog by job state, and the live
workers. Every worker exports the same values (the database is one), so a query takes `max`, not `sum`:
`max(specq_backlog_requests) by (job_state)`. They stay right when no worker is busy, and the alert
"backlog with no live worker" needs them from whichever worker is still up, or from the last scrape.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from specq.db.models import Job, Worker
from specq.db.session import Database
from specq.db.states import JobState, WorkerState
from specq.db.types import utcnow

log = logging.getLogger(__name__)


class FleetCollector(Collector):
    def __init__(self, db: Database, live_after_s: float) -> None:
        self.db, self.live_after_s = db, live_after_s

    def collect(self) -> Iterator[Metric]:
        backlog = GaugeMetricFamily(
            "specq_backlog_requests",
            "Requests not yet ended (queued or running), over the jobs in each state.",
            labels=["job_state"],
        )
        workers = GaugeMetricFamily("specq_live_workers", "Workers with a recent heartbeat, not stopped.")
        try:
            with self.db.session() as session:
                remaining = dict(
                    session.execute(  # type: ignore[arg-type]
                        select(Job.state, func.coalesce(func.sum(Job.total - Job.completed - Job.failed), 0))
                        .where(Job.state.in_([JobState.QUEUED, JobState.RUNNING]))
                        .group_by(Job.state)
                    ).all()
                )
                live = session.scalar(
                    select(func.count())
                    .select_from(Worker)
                    .where(
                        Worker.state != WorkerState.STOPPED,
                        Worker.heartbeat_at >= utcnow() - timedelta(seconds=self.live_after_s),
                    )
                )
        except SQLAlchemyError as exc:  # no value is better than a wrong one: the scrape shows the gap
            log.debug("fleet gauges not read: %s", exc)
            return
        for state in (JobState.QUEUED, JobState.RUNNING):
            backlog.add_metric([str(state)], float(remaining.get(state, 0)))
        workers.add_metric([], float(live or 0))
        yield backlog
        yield workers
