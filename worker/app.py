"""The one Celery app: JSON only, late acks, one prefetched task, tasks of lost workers rejected.

The broker URL is set by `configure` (from `--broker-url` / `SPECQ_BROKER_URL`), so importing this
module connects to nothing.
"""

from __future__ import annotations

from celery import Celery

from specq.worker import broker_transport
from specq.worker.constants import (
    CHUNK_QUEUE,
    KEY_PREFIX,
    PROCESS_CHUNK_TASK,
    UNACKED_INDEX_KEY,
    UNACKED_KEY,
    UNACKED_MUTEX_KEY,
)
from specq.worker.settings import QUEUE

broker_transport.install()  # a worker must keep consuming after Redis restarts mid-task
app = Celery("specq", set_as_current=False)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_accept_content=["json"],
    task_ignore_result=True,  # results go to the database, not to a Celery backend
    task_acks_late=True,  # ack after the chunk ran: a worker that dies mid-chunk loses no task
    task_reject_on_worker_lost=True,  # ... and the task of a lost child process is requeued
    worker_prefetch_multiplier=1,  # a worker holds one chunk at a time; the rest stay for others
    task_default_queue=CHUNK_QUEUE,
    task_routes={PROCESS_CHUNK_TASK: {"queue": CHUNK_QUEUE}},
    task_create_missing_queues=True,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=3,
    broker_transport_options={
        "visibility_timeout": QUEUE.visibility_timeout_s,
        "global_keyprefix": KEY_PREFIX,
        "unacked_key": UNACKED_KEY,
        "unacked_index_key": UNACKED_INDEX_KEY,
        "unacked_mutex_key": UNACKED_MUTEX_KEY,
        "socket_connect_timeout": 5,
    },
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
    task_send_sent_event=False,
    worker_enable_remote_control=False,  # no pidbox fan-out keys: workers are listed from the database
)


def configure(broker_url: str) -> Celery:
    app.conf.broker_url = broker_url
    return app
