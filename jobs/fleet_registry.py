"""What the live workers serve, and the chunk messages they set aside, in Redis beside the queue.

The workers table lives in the database, so a client pointed at another database cannot see the fleet
there. Each worker therefore also keeps one key on the broker, `specq:serving:NAME`, holding the identity
of the database it serves (`db.session.identity`: the PostgreSQL cluster's identifier and the database's
name, never a URL or a credential) and how many messages it set aside; the key expires `live_after`
seconds after its last heartbeat, so a killed worker drops out without anyone cleaning up.

A chunk message naming another database than the worker's is *dead-lettered*: pushed onto the capped
list `specq:dead_letter` (newest first) and counted in `specq:dead_lettered`, then acknowledged. One
worker sees it, not the whole fleet in turn. Its job is not lost: the requests stay queued in their own
database, where a sweeper of a fleet serving that database enqueues the chunk again (`worker.recovery`).
`submit` refuses up front when live workers on its broker serve only other databases.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from specq.db.types import utcnow
from specq.errors import FleetMismatchError
from specq.masking import mask_url
from specq.queue import DEAD_LETTER_CAP, DEAD_LETTER_KEY, DEAD_LETTERED_KEY, SERVING_KEY_PREFIX, Chunk

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Serving:
    """One live worker's entry: where it reports, and what it set aside."""

    name: str
    device: str
    database: str | None  # db.session.identity of its database; None: SQLite (no check)
    dead_lettered: int = 0  # chunk messages this worker set aside


def broker_client(broker: str) -> Any:
    """A Redis client of the broker with short timeouts: these reads and writes never hold a command up."""
    import redis

    return redis.Redis.from_url(broker, socket_connect_timeout=5, socket_timeout=5)


def publish(client: Any, entry: Serving, ttl_s: float) -> None:
    """Write (or refresh) the worker's entry, to expire `ttl_s` from now unless written again."""
    client.set(SERVING_KEY_PREFIX + entry.name, json.dumps(asdict(entry)), ex=max(1, math.ceil(ttl_s)))


def withdraw(client: Any, name: str) -> None:
    """A worker that stops removes its entry at once (a killed one's expires)."""
    client.delete(SERVING_KEY_PREFIX + name)


def live_entries(client: Any) -> dict[str, Serving]:
    """The entries of the live workers, by name; an entry that is not what a worker writes is skipped."""
    found: dict[str, Serving] = {}
    for key in client.scan_iter(match=SERVING_KEY_PREFIX + "*", count=100):
        raw = client.get(key)
        entry = _entry(raw) if raw is not None else None
        if entry is not None:
            found[entry.name] = entry
    return found


def _entry(raw: bytes | str) -> Serving | None:
    try:
        data = json.loads(raw)
        return Serving(
            name=str(data["name"]),
            device=str(data["device"]),
            database=None if data["database"] is None else str(data["database"]),
            dead_lettered=int(data.get("dead_lettered", 0)),
        )
    except (ValueError, KeyError, TypeError):
        return None


def dead_letter(client: Any, chunk: Chunk, database: str, worker: str) -> int:
    """Set a chunk message aside: pushed onto the capped list and counted, in one transaction; returns
    how many messages were set aside in all."""
    job_id, first, end = chunk
    entry = {
        "job_id": job_id,
        "first": first,
        "end": end,
        "database": database,
        "worker": worker,
        "at": utcnow().isoformat(),
    }
    pipe = client.pipeline(transaction=True)
    pipe.lpush(DEAD_LETTER_KEY, json.dumps(entry))
    pipe.ltrim(DEAD_LETTER_KEY, 0, DEAD_LETTER_CAP - 1)
    pipe.incr(DEAD_LETTERED_KEY)
    return int(pipe.execute()[-1])


def dead_lettered(client: Any) -> int:
    """How many chunk messages were ever set aside on this broker."""
    value = client.get(DEAD_LETTERED_KEY)
    return int(value) if value is not None else 0


def describe(database: str | None) -> str:
    """An identity as a person reads it: `database NAME on cluster ID`."""
    if database is None:
        return "an SQLite file"
    cluster, _, name = database.partition("/")
    return f"database {name!r} on cluster {cluster}"


def check_fleet_serves(broker: str, database: str | None) -> None:
    """Raise FleetMismatchError when live workers on `broker` exist and none serves `database` (they
    would set the job's chunks aside unrun). No live worker, or an SQLite store (no identity): no check;
    the broker's own failures are left to the enqueue that follows."""
    import redis

    if database is None:
        return
    client = broker_client(broker)
    try:
        entries = list(live_entries(client).values())
    except redis.RedisError as exc:
        log.debug("cannot read the live workers' databases (%s); not checked", exc)
        return
    finally:
        client.close()
    if not entries or any(e.database == database for e in entries):
        return
    theirs = sorted({describe(e.database) for e in entries})
    count = f"{len(entries)} live worker{'s' if len(entries) != 1 else ''}"
    raise FleetMismatchError(
        f"the {count} on the broker at {mask_url(broker)} serve {', '.join(theirs)}, not this job's "
        f"{describe(database)}: they would set its chunks aside unrun, so nothing was stored; submit with "
        "their SPECQ_DATABASE_URL, or start a worker on this database"
    )


@dataclass(frozen=True)
class FleetView:
    """What the broker says of the fleet: each live worker's entry by name, and the messages set aside."""

    entries: dict[str, Serving]
    dead_lettered: int


def read_fleet(broker: str) -> FleetView | None:
    """The broker's view of the fleet; None when the broker does not answer (the caller shows the
    database's view alone)."""
    import redis

    client = broker_client(broker)
    try:
        return FleetView(live_entries(client), dead_lettered(client))
    except (redis.RedisError, OSError) as exc:
        log.debug("cannot read the fleet from the broker (%s)", exc)
        return None
    finally:
        client.close()
