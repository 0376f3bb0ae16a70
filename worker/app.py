"""The worker's side of the one Celery app (`specq.queue.celery_app`: JSON only, late acks, one
prefetched task, tasks of lost workers rejected), with kombu's Redis transport patched for consumers.

The broker URL is set by `configure` (from `--broker-url` / `SPECQ_BROKER_URL`), so importing this
module connects to nothing.
"""

from __future__ import annotations

from celery import Celery

from specq.queue import celery_app
from specq.worker import broker_transport

broker_transport.install()  # a worker must keep consuming after Redis restarts mid-task
app = celery_app()


def configure(broker_url: str) -> Celery:
    return celery_app(broker_url)
