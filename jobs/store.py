"""Bulk insert of a job's requests: COPY on PostgreSQL, executemany on SQLite; memory flat either way."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

import orjson
from sqlalchemy.orm import Session

from specq.db.states import RequestState
from specq.jobs.inputs import RequestSpec
from specq.jobs.params import choice_overrides

COLUMNS = (
    "job_id",
    "seq",
    "line",
    "custom_id",
    "kind",
    "prompt",
    "messages",
    "prompt_token_ids",
    "overrides",
    "model",
    "choice_index",
    "state",
    "attempts",
)
SQLITE_BATCH = 10_000  # rows per executemany call


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()  # compact UTF-8 JSON; tuples (`stop`) become lists


def _rows(job_id: str, specs: Iterable[RequestSpec]) -> Iterator[tuple[Any, ...]]:
    """One row a request: a line with `n` > 1 is n requests, its choices, at consecutive positions."""
    queued = str(RequestState.QUEUED)
    seq = 0
    for spec in specs:
        messages = None if spec.messages is None else _dumps(spec.messages)
        token_ids = None if spec.prompt_token_ids is None else _dumps(spec.prompt_token_ids)
        for choice in range(spec.n):
            overrides = choice_overrides(spec.overrides, choice)
            yield (
                job_id,
                seq,
                spec.line,
                spec.id,
                spec.kind,
                spec.prompt,
                messages,
                token_ids,
                _dumps(overrides) if overrides else "{}",  # `stop`, a tuple, becomes a JSON list
                spec.model,
                choice,
                queued,
                0,
            )
            seq += 1


def insert_requests(session: Session, job_id: str, specs: Iterable[RequestSpec]) -> int:
    """Insert the requests in order (seq 0, 1, ...) inside the session's transaction; returns the count."""
    connection = session.connection()
    count = 0
    if connection.dialect.name == "postgresql":
        raw = connection.connection.driver_connection
        assert raw is not None
        from psycopg.copy import QueuedLibpqWriter

        with raw.cursor() as cursor:
            statement = f"COPY requests ({', '.join(COLUMNS)}) FROM STDIN"
            # a writer thread sends while this one parses the next lines: the server ingests in parallel
            writer = QueuedLibpqWriter(cursor)  # type: ignore[arg-type]
            with cursor.copy(statement, writer=writer) as copy:  # type: ignore[attr-defined]
                for row in _rows(job_id, specs):
                    copy.write_row(row)
                    count += 1
        return count
    statement = f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
    rows = _rows(job_id, specs)
    while batch := list(islice(rows, SQLITE_BATCH)):
        connection.exec_driver_sql(statement, batch)
        count += len(batch)
    return count
