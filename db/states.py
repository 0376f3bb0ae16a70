"""Job and request states, and the one table of allowed transitions (rq's JobStatus, as a StrEnum).

States are stored as plain strings (no database ENUM), so adding one needs no migration of the type.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "queued"  # stored and enqueued; no request claimed yet (or requeued by `retry`)
    RUNNING = "running"  # some request has been claimed by a worker
    COMPLETED = "completed"  # terminal: every request ended and at least one completed
    FAILED = "failed"  # terminal: every request ended and every one failed
    CANCELLED = "cancelled"  # terminal: stopped by `cancel`; requests that had ended keep their results
    # terminal: its completion window ended first; requests that had ended keep their results, those
    # running then finish, those not started are expired (OpenAI Batch's `expired`)
    EXPIRED = "expired"


class RequestState(StrEnum):
    QUEUED = "queued"  # waiting for a worker to claim it
    RUNNING = "running"  # claimed under a lease (lease_owner, lease_expires_at)
    COMPLETED = "completed"  # terminal: has a completion in results
    FAILED = "failed"  # has an error in results; `retry` may requeue it
    CANCELLED = "cancelled"  # never ran: its job was cancelled first; `retry` may requeue it
    EXPIRED = "expired"  # never ran: its job's completion window ended first; `retry` may requeue it


JOB_TERMINAL = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED})
# a job in one of these has nothing for a worker to claim
NOT_CLAIMABLE = frozenset({JobState.CANCELLED, JobState.EXPIRED})

# state -> the states it may move to; every state change in the code is guarded by this table
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.EXPIRED}),
    JobState.RUNNING: frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED}),
    JobState.COMPLETED: frozenset({JobState.QUEUED}),  # `retry` of the requests that failed
    JobState.FAILED: frozenset({JobState.QUEUED}),
    JobState.CANCELLED: frozenset({JobState.QUEUED}),
    JobState.EXPIRED: frozenset({JobState.QUEUED}),  # `retry`, which lifts the window
}
REQUEST_TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.QUEUED: frozenset({RequestState.RUNNING, RequestState.CANCELLED, RequestState.EXPIRED}),
    # a running request whose lease expired (its worker died) is claimed again (running -> running) or put
    # back by the sweeper (running -> queued)
    # running -> cancelled: its worker saw the job cancelled and gave it up before it ran, or its worker
    # died after the job was cancelled (the sweeper ends it with its job); running -> expired likewise
    RequestState.RUNNING: frozenset(
        {
            RequestState.QUEUED,
            RequestState.RUNNING,
            RequestState.COMPLETED,
            RequestState.FAILED,
            RequestState.CANCELLED,
            RequestState.EXPIRED,
        }
    ),
    RequestState.COMPLETED: frozenset(),
    RequestState.FAILED: frozenset({RequestState.QUEUED}),
    RequestState.CANCELLED: frozenset({RequestState.QUEUED}),
    RequestState.EXPIRED: frozenset({RequestState.QUEUED}),
}


def job_sources(target: JobState) -> list[str]:
    """The job states that may move to `target`, for a guarded `UPDATE ... WHERE state IN (...)`."""
    return [str(s) for s, targets in JOB_TRANSITIONS.items() if target in targets]


def request_sources(target: RequestState) -> list[str]:
    """The request states that may move to `target`."""
    return [str(s) for s, targets in REQUEST_TRANSITIONS.items() if target in targets]


class DraftTrainingState(StrEnum):
    """A `--draft train:N` job's head (its `trained_drafts` row; no row yet: waiting for the first N)."""

    TRAINING = "training"  # claimed by a worker under a lease (owner, lease_expires_at)
    READY = "ready"  # terminal: trained and measured useful; the rest of the job speculates with it
    FAILED = "failed"  # terminal: training raised (no completion to learn from, out of memory, ...)
    UNTRAINED = "untrained"  # terminal: its budget was spent before a training step could run
    REJECTED = "rejected"  # terminal: trained, but its own data says it proposes worse than no draft


# a lapsed claim is taken over (training -> training); a claim given back deletes the row; only a
# ready head is ever loaded, so the rest of a job whose head ended otherwise runs without it
DRAFT_TRAINING_TRANSITIONS: dict[DraftTrainingState, frozenset[DraftTrainingState]] = {
    DraftTrainingState.TRAINING: frozenset(DraftTrainingState),
    DraftTrainingState.READY: frozenset(),
    DraftTrainingState.FAILED: frozenset(),
    DraftTrainingState.UNTRAINED: frozenset(),
    DraftTrainingState.REJECTED: frozenset(),
}


class WorkerState(StrEnum):
    IDLE = "idle"  # waiting for a chunk
    LOADING = "loading"  # loading the models of the chunk it claimed (workers.current_job's)
    BUSY = "busy"  # running a batch (workers.current_batch)
    STOPPED = "stopped"  # terminal: shut down cleanly
