"""What both sides of the queue share, in one low-level module (arq's `constants.py`): the Redis key,
queue and task names under the `specq:` prefix, the queue's timing, and the Celery app's configuration.

`jobs` sends chunk tasks by name through `celery_app()` and never imports the worker; `worker` registers
the task on the same app and consumes. Importing this module loads no Celery and connects to nothing.

Queue timing, one frozen dataclass (nanoGPT's GPTConfig style), and how the numbers fit together:
a job is split into chunks of `chunk_size` requests, one Celery task each. A worker claims a chunk's
requests under a lease of `lease_s` and renews it every `heartbeat_s` while it runs, so a lease only
expires when its worker is gone; then any worker's sweeper puts the requests back and enqueues them again.
Redis redelivers an unacknowledged task after `visibility_timeout_s`, which must stay above the longest
a chunk may run, else a healthy chunk is delivered twice (harmless: the copy finds every request leased
and claims nothing, but it costs a queue slot). specq does not wait for that redelivery: the database is
the truth, and the sweeper also enqueues again the chunks of a job that hold queued requests but have no
message in Redis (a Redis restart loses them all), once the job's last enqueue is `lost_after_s` old.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from specq.errors import ConfigError

if TYPE_CHECKING:
    from celery import Celery

KEY_PREFIX = "specq:"  # kombu's global_keyprefix: every key the broker writes starts with it
CHUNK_QUEUE = "chunks"  # Celery queue name; its Redis list is KEY_PREFIX + CHUNK_QUEUE
CHUNK_QUEUE_KEY = KEY_PREFIX + CHUNK_QUEUE  # LLEN of this is the backlog, in chunk tasks
UNACKED_KEY = "unacked"  # kombu's hash of delivered, not yet acknowledged messages (prefixed too)
UNACKED_INDEX_KEY = "unacked_index"
UNACKED_MUTEX_KEY = "unacked_mutex"
PROCESS_CHUNK_TASK = "specq.process_chunk"  # the task name, so senders need not import the worker
Chunk = tuple[str, int, int]  # a chunk task's arguments: (job_id, first, end), positions [first, end)
# specq's own keys beside kombu's (jobs/fleet_registry.py): what each live worker serves, one key per
# worker that expires with its heartbeat; chunk messages naming a database the worker does not serve, set
# aside (newest first, capped), and how many ever were
SERVING_KEY_PREFIX = KEY_PREFIX + "serving:"
DEAD_LETTER_KEY = KEY_PREFIX + "dead_letter"
DEAD_LETTERED_KEY = KEY_PREFIX + "dead_lettered"
DEAD_LETTER_CAP = 1000  # entries kept in DEAD_LETTER_KEY; the count goes on

BROKER_ENV = "SPECQ_BROKER_URL"
# the timings a deployment (or a test) may set, each as its environment variable
TIMING_ENV = {name: f"SPECQ_{name.upper()}" for name in ("heartbeat_s", "lease_s", "sweep_s", "lost_after_s")}

# A request whose worker died this many times while it was in the engine is failed, not run again (a
# prompt that crashes the process must not take the fleet down forever); a job may set its own.
DEFAULT_MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class QueueSettings:
    # A job is cut into about `target_chunks` chunks, so that many workers can share it, each of at
    # least `min_batches_per_chunk` batches (continuous batching keeps its slots full within a chunk) and
    # at most `max_chunk_size` requests (a lost worker costs little; 1M lines are ~1000 tasks to enqueue)
    target_chunks: int = 256
    min_batches_per_chunk: int = 4
    max_chunk_size: int = 1024
    heartbeat_s: float = 5.0  # workers table heartbeat and lease renewal
    # a claim with no renewal for this long belongs to a dead worker: 9 missed heartbeats, so a busy
    # host does not lose leases, and with `sweep_s` a dead worker's requests are back within a minute
    lease_s: float = 45.0
    sweep_s: float = 10.0  # how often a worker looks for expired leases and lost chunks
    # a worker whose heartbeat is older than this is not listed as live (None: lease_s, the age at which
    # its leases are taken back too)
    live_s: float | None = None
    # a job's chunks are checked for lost messages only once its last enqueue is this old (by default
    # lease_s): the time for an enqueue in progress to land, and how often one job's check may run
    lost_after_s: float | None = None
    # a chunk of max_chunk_size requests at max_tokens 1024 is ~1M decoded tokens: under 2 hours even at
    # a slow 200 tokens/s; Redis redelivers only after this
    visibility_timeout_s: int = 4 * 3600

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s * 3 <= self.lease_s:
            raise ValueError("lease_s must cover at least 3 heartbeats, so one late beat loses no lease")
        if self.lease_s >= self.visibility_timeout_s:
            raise ValueError("visibility_timeout_s must exceed lease_s: the sweeper, not Redis, recovers first")
        if not self.sweep_s > 0:
            raise ValueError("sweep_s must be > 0")
        if min(self.target_chunks, self.min_batches_per_chunk, self.max_chunk_size) < 1:
            raise ValueError("target_chunks, min_batches_per_chunk and max_chunk_size must be >= 1")
        if self.lost_after_s is not None and self.lost_after_s <= 0:
            raise ValueError("lost_after_s must be > 0")
        if self.live_s is not None and self.live_s <= 0:
            raise ValueError("live_s must be > 0")

    @property
    def live_after(self) -> float:
        """Seconds without a heartbeat after which a worker is listed as lost."""
        return self.lease_s if self.live_s is None else self.live_s

    @property
    def lost_after(self) -> float:
        """Seconds after a job's last enqueue before its chunks are checked for lost messages."""
        return self.lease_s if self.lost_after_s is None else self.lost_after_s

    def chunk_size(self, total: int, batch_size: int) -> int:
        """Requests per chunk task for a job of `total` requests decoded `batch_size` at a time."""
        wanted = max(-(-total // self.target_chunks), self.min_batches_per_chunk * batch_size)
        return max(1, min(self.max_chunk_size, wanted))

    @classmethod
    def from_env(cls) -> QueueSettings:
        """Defaults, with the timings overridable as SPECQ_HEARTBEAT_S, SPECQ_LEASE_S, SPECQ_SWEEP_S,
        SPECQ_LOST_AFTER_S (tests shorten them to watch a dead worker's requests come back within seconds).

        Read when a command needs them (never at import), so a bad value fails only those commands, with
        a ConfigError naming the variable: not a finite number, or timings that do not fit together."""
        overrides: dict[str, Any] = {}
        for name, env in TIMING_ENV.items():
            value = os.environ.get(env)
            if not value:
                continue
            try:
                overrides[name] = float(value)
            except ValueError:
                overrides[name] = math.nan
            if not math.isfinite(overrides[name]):
                raise ConfigError(f"{env} must be a finite number of seconds, got {value!r}")
        try:
            return cls(**overrides)
        except ValueError as exc:
            given = ", ".join(f"{TIMING_ENV[name]}={os.environ[TIMING_ENV[name]]}" for name in overrides)
            raise ConfigError(f"bad queue timings ({given or 'the defaults'}): {exc}") from None


def celery_config(queue: QueueSettings | None = None) -> dict[str, Any]:
    """The Celery configuration both sides use: JSON only, late acks, one prefetched task, tasks of
    lost workers rejected, every key under KEY_PREFIX. `queue`: None reads it from the environment."""
    if queue is None:
        queue = QueueSettings.from_env()
    return {
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_ignore_result": True,  # results go to the database, not to a Celery backend
        "task_acks_late": True,  # ack after the chunk ran: a worker that dies mid-chunk loses no task
        "task_reject_on_worker_lost": True,  # ... and the task of a lost child process is requeued
        "worker_prefetch_multiplier": 1,  # a worker holds one chunk at a time; the rest stay for others
        "task_default_queue": CHUNK_QUEUE,
        "task_routes": {PROCESS_CHUNK_TASK: {"queue": CHUNK_QUEUE}},
        "task_create_missing_queues": True,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": 3,
        "broker_transport_options": {
            "visibility_timeout": queue.visibility_timeout_s,
            "global_keyprefix": KEY_PREFIX,
            "unacked_key": UNACKED_KEY,
            "unacked_index_key": UNACKED_INDEX_KEY,
            "unacked_mutex_key": UNACKED_MUTEX_KEY,
            "socket_connect_timeout": 5,
        },
        "worker_hijack_root_logger": False,
        # Celery's own tools see the fleet: `celery inspect ping|active|stats` (remote control) and Flower
        # (task events, with the sent event so a queued chunk shows before a worker takes it); all JSON
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_enable_remote_control": True,
        "event_serializer": "json",
    }


_app: Celery | None = None
_app_lock = threading.Lock()  # the heartbeat thread may send before the task thread does


def celery_app(broker_url: str | None = None) -> Celery:
    """The process's one Celery app, made on first use with `celery_config()`; `broker_url`, when given,
    is where it connects from now on. Senders use it by task name; the worker registers its task on it."""
    global _app
    with _app_lock:
        if _app is None:
            from celery import Celery

            _app = Celery("specq", set_as_current=False)
            _app.conf.update(celery_config())
        if broker_url is not None:
            _app.conf.broker_url = broker_url
        return _app
