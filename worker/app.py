"""The worker's side of the one Celery app (`specq.queue.celery_app`: JSON only, late acks, one
prefetched task, tasks of lost workers rejected), with kombu's Redis transport patched for consumers.

The broker URL is `SPECQ_BROKER_URL` when set (so `celery -A specq.worker.app inspect ping` and Flower
find the fleet with no `-b`), and `configure` sets it from `--broker-url`; importing this module
connects to nothing.
"""

from __future__ import annotations

import os

from celery import Celery

from specq.queue import BROKER_ENV, celery_app
from specq.worker import broker_transport

broker_transport.install()  # a worker must keep consuming after Redis restarts mid-task
app = celery_app(os.environ.get(BROKER_ENV) or None)


def configure(broker_url: str) -> Celery:
    return celery_app(broker_url)
