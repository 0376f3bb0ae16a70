"""What a chunk runs with, one per worker process (or per in-process `submit`), in three parts:

- `WorkerConfig`: who the worker is and where it reports, fixed for the process (frozen);
- the resources its chunks use: the database, the model cache, the adaptive-k policies, metrics;
- `SharedState`: the little the task thread shares with the heartbeat thread (`worker.heartbeat`) and
  the SIGTERM handler, with the lock that orders them. Nothing else crosses threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from specq.db.session import Database
from specq.queue import Chunk, QueueSettings
from specq.worker.model_cache import ModelCache

if TYPE_CHECKING:
    from specq.decoding.config import PolicyKey
    from specq.decoding.draft_head import DraftHead
    from specq.decoding.k_policy import SpeculationPolicy
    from specq.decoding.suffix_index import SuffixIndex
    from specq.worker.metrics import WorkerMetrics


@dataclass(frozen=True)
class WorkerConfig:
    name: str  # the lease owner and the workers-table row
    device: str
    queue: QueueSettings = field(default_factory=QueueSettings.from_env)
    registered: bool = False  # True: a row in the workers table shows this worker's state
    broker: str | None = None  # where requests given back are enqueued again; None: in-process


class SharedState:
    """Between the task thread, the heartbeat thread and the SIGTERM handler."""

    def __init__(self) -> None:
        # set on SIGTERM: the batch in hand finishes, the rest of the chunk goes back to the queue
        self.stopping = threading.Event()
        # the claims of the chunk in hand, whose leases the heartbeat renews (replaced, never mutated, so
        # one read is a consistent snapshot)
        self.holding: frozenset[int] = frozenset()
        # chunks a database error cut short -> their claims, which the heartbeat gives back (queued, chunk
        # enqueued again) as soon as the database answers, instead of leaving them to expire
        self.abandoned: dict[Chunk, frozenset[int]] = {}
        # why this worker cannot serve (its models do not load here), set by the task thread: the chunk in
        # hand was given back and the worker exits (`worker.startup.EXIT_MODEL_UNLOADABLE`)
        self.unusable: str | None = None
        # chunk messages this worker set aside (they named another database: `worker.serving`); written by
        # the task thread, read by the heartbeat into this worker's entry on the broker
        self.dead_lettered = 0
        # taken while claiming and while giving abandoned claims back: the two never cross
        self.lock = threading.Lock()

    def abandon(self, chunk: Chunk) -> None:
        """The chunk in hand was cut short by a database error: its claims are to be given back."""
        with self.lock:
            self.abandoned[chunk] = self.abandoned.get(chunk, frozenset()) | self.holding


MAX_SUFFIX_INDEXES = 4  # jobs whose suffix index a worker keeps (each bounded: decoding/suffix_index.py)


class WorkerContext:
    def __init__(
        self,
        db: Database,
        name: str,
        device: str,
        *,
        models: ModelCache | None = None,
        queue: QueueSettings | None = None,
        metrics: WorkerMetrics | None = None,
        registered: bool = False,
        broker: str | None = None,
    ) -> None:
        self.config = WorkerConfig(name, device, queue or QueueSettings.from_env(), registered, broker)
        self.db = db
        self.models = models if models is not None else ModelCache()
        # one adaptive-k policy per model pair and speculation setting, so the step times and acceptance it
        # measured carry over from batch to batch instead of being learnt again each time
        self.policies: dict[PolicyKey, SpeculationPolicy] = {}
        # the suffix index of each job this worker serves with `--draft suffix`, fed by its prompts and
        # outputs from batch to batch; the least recently served beyond MAX_SUFFIX_INDEXES dropped
        self.suffix_indexes: OrderedDict[str, SuffixIndex] = OrderedDict()
        # job id -> (the target it is loaded onto, the draft head the job trained for itself), for the
        # jobs with `--draft train:N` this worker serves (worker/trained_draft.py)
        self.trained_heads: OrderedDict[str, tuple[Any, DraftHead]] = OrderedDict()
        self.metrics = metrics
        self.shared = SharedState()
        # the task thread's own memory: requests this process marked started and has not finished; when
        # a chunk is retried here (the database went away) they are neither suspects nor counted again
        self.started: set[int] = set()
        # what the workers-table row says `--compile` did with the models loaded last (worker.chunk)
        self.compiled_recorded: dict[str, Any] | None = None

    def suffix_index(self, job_id: str) -> SuffixIndex:
        """The job's suffix index in this worker, created on first use."""
        from specq.decoding.suffix_index import SuffixIndex

        index = self.suffix_indexes.pop(job_id, None)
        if index is None:  # not `or`: an empty index is falsy (len 0)
            index = SuffixIndex()
        self.suffix_indexes[job_id] = index
        while len(self.suffix_indexes) > MAX_SUFFIX_INDEXES:
            self.suffix_indexes.popitem(last=False)
        return index
