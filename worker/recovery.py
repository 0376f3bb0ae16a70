"""Chunks whose broker message was lost: found by comparing the database (the truth) with Redis.

Redis keeps the queue in memory only (here with no persistence at all), so a restart drops every
queued message and every delivered-but-unacknowledged one; Redis' own redelivery (the visibility
timeout) cannot bring back what it no longer holds. The database still says which requests are queued.

The rule: a chunk is *lost* when it holds a queued request of an unfinished job and no message for it is
in the broker (neither waiting in the queue list nor delivered and unacknowledged). Jobs are looked at
only once their last enqueue is `lost_after_s` old (an enqueue in flight has landed by then), each
under a row lock taken with SKIP LOCKED, and their `enqueued_at` is reset in the same transaction: one
worker checks a job at a time, and each job at most once per `lost_after_s`. A message that is in
flight (popped by a worker, not yet in the unacknowledged hash) may be sent twice; the copy finds
nothing to claim. Jobs that run in-process (`enqueued_at` None) are never touched.
"""

from __future__ import annotations

import base64
import json
import logging
from datetime import timedelta
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from specq.db.models import Job, Request
from specq.db.states import JobState, RequestState
from specq.db.types import utcnow
from specq.jobs.settings import JobSettings
from specq.queue import CHUNK_QUEUE_KEY, KEY_PREFIX, PROCESS_CHUNK_TASK, UNACKED_KEY, Chunk

log = logging.getLogger(__name__)


def _chunk_of(raw: bytes | str) -> Chunk | None:
    """The (job_id, first, end) of one kombu message on the Redis transport, or None when it is not a
    JSON chunk task (anything else is ignored, never decoded further)."""
    try:
        message = json.loads(raw)
        if message.get("content-type") != "application/json":
            return None
        if (message.get("headers") or {}).get("task") != PROCESS_CHUNK_TASK:
            return None
        body = message["body"]
        if (message.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        job_id, first, end = args
        return str(job_id), int(first), int(end)
    except (ValueError, KeyError, TypeError, IndexError):
        return None


def chunks_in_broker(client: Any) -> set[Chunk]:
    """The chunks that have a message in Redis: waiting in the queue, or delivered and not acknowledged
    (kombu keeps those in a hash as [message, exchange, routing key])."""
    found: set[Chunk] = set()
    for raw in client.lrange(CHUNK_QUEUE_KEY, 0, -1):
        chunk = _chunk_of(raw)
        if chunk is not None:
            found.add(chunk)
    for raw in client.hvals(KEY_PREFIX + UNACKED_KEY):
        try:
            message = json.loads(raw)[0]
        except (ValueError, KeyError, TypeError, IndexError):
            continue
        chunk = _chunk_of(json.dumps(message))
        if chunk is not None:
            found.add(chunk)
    return found


def stale_jobs(session: Session, lost_after_s: float) -> list[tuple[str, int, int]]:
    """Unfinished queue jobs last enqueued more than `lost_after_s` ago, locked for this transaction
    (others skip them): (job_id, chunk_size, total) each. Their `enqueued_at` is reset to now."""
    now = utcnow()
    jobs = session.execute(
        select(Job.id, Job.settings, Job.total)
        .where(
            Job.state.in_([JobState.QUEUED, JobState.RUNNING]),
            Job.enqueued_at.is_not(None),
            Job.enqueued_at < now - timedelta(seconds=lost_after_s),
        )
        .with_for_update(skip_locked=True)
    ).all()
    if jobs:
        session.execute(
            update(Job)
            .where(Job.id.in_([job_id for job_id, _, _ in jobs]))
            .values(enqueued_at=now)
            .execution_options(synchronize_session=False)
        )
    return [(job_id, JobSettings.from_stored(settings).chunk_size, total) for job_id, settings, total in jobs]


def queued_chunks(session: Session, job_id: str, chunk_size: int, total: int) -> list[Chunk]:
    """The job's chunks that hold a queued request."""
    indexes = session.scalars(
        select(Request.seq // chunk_size)
        .where(Request.job_id == job_id, Request.state == RequestState.QUEUED)
        .distinct()
    ).all()
    return [(job_id, int(i) * chunk_size, min((int(i) + 1) * chunk_size, total)) for i in sorted(indexes)]


def lost_chunks(session: Session, client: Any, lost_after_s: float) -> list[Chunk]:
    """The chunks to enqueue again (see the module docstring); the caller enqueues them, then commits."""
    jobs = stale_jobs(session, lost_after_s)
    if not jobs:
        return []
    present = chunks_in_broker(client)
    lost: list[Chunk] = []
    for job_id, chunk_size, total in jobs:
        lost += [chunk for chunk in queued_chunks(session, job_id, chunk_size, total) if chunk not in present]
    return lost
