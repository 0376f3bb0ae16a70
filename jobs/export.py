"""`specq export`: stream a job's requests and results to a file, in input order, flat in memory.

Rows come through a server-side cursor on PostgreSQL (`yield_per`), so 1M results cost what 1k do.
Every request of the job has a line; one that never ran (its job was cancelled, or is still waiting)
has no completion and says why in `error` (jsonl, openai) or `status` (csv).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

from sqlalchemy import select

from specq.db.models import Job, Request, Result
from specq.db.session import Database, schema_ready
from specq.errors import JobNotFoundError
from specq.jobs.output_file import open_output
from specq.jobs.outputs import csv_row, openai_record, result_record, write_csv, write_jsonl

ExportFormat = Literal["csv", "jsonl", "openai"]
FORMATS: tuple[ExportFormat, ...] = ("csv", "jsonl", "openai")
YIELD_PER = 1000  # rows fetched from the server at a time


class StoredResult(NamedTuple):
    """A result as stored: what jobs.outputs reads of a GenerationResult (no torch needed to export)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int
    accepted_tokens: int
    error: str | None


def _rows(db: Database, job_id: str) -> Iterator[tuple[dict[str, Any], StoredResult | None, str]]:
    """(request fields, its result or None, request state) for every request, in input order."""
    stmt = (
        select(
            Request.id,
            Request.custom_id,
            Request.kind,
            Request.prompt,
            Request.messages,
            Request.prompt_token_ids,
            Request.state,
            Result.completion,
            Result.token_ids,
            Result.finish_reason,
            Result.prompt_tokens,
            Result.completion_tokens,
            Result.draft_tokens,
            Result.accepted_tokens,
            Result.error,
            Result.status,
        )
        .outerjoin(Result, Result.request_id == Request.id)
        .where(Request.job_id == job_id)
        .order_by(Request.seq)
        .execution_options(yield_per=YIELD_PER)
    )
    with db.engine.connect() as conn:
        for row in conn.execute(stmt):
            request = {
                "id": row.custom_id,
                "kind": row.kind,
                "prompt": row.prompt,
                "messages": row.messages,
                "prompt_token_ids": row.prompt_token_ids,
            }
            if row.status is None:
                yield request, None, row.state
                continue
            result = StoredResult(
                token_ids=row.token_ids or [],
                text=row.completion or "",
                finish_reason=row.finish_reason,
                prompt_tokens=row.prompt_tokens,
                completion_tokens=row.completion_tokens,
                draft_tokens=row.draft_tokens,
                accepted_tokens=row.accepted_tokens,
                error=row.error,
            )
            yield request, result, row.status


def _not_run(state: str) -> StoredResult:
    return StoredResult([], "", None, 0, 0, 0, 0, f"the request did not run ({state})")


def export_job(db: Database, job_id: str, path: str, fmt: ExportFormat = "csv", *, csv_raw: bool = False) -> int:
    """Write the job's results to `path` in `fmt`; returns the number of requests written. CSV text
    cells that a spreadsheet would run get a leading `'` unless `csv_raw` (jobs.outputs.defused)."""
    with db.session() as session:
        job = session.get(Job, job_id) if schema_ready(db) else None
        if job is None:
            raise JobNotFoundError(f"no job has the id {job_id!r}")
        target = job.target
    rows = _rows(db, job_id)
    with open_output(path) as out:
        if fmt == "csv":
            return write_csv(out, (csv_row(request, result, state) for request, result, state in rows), raw=csv_raw)
        if fmt == "jsonl":
            return write_jsonl(
                out,
                (
                    result_record(request, result or _not_run(state), with_tokens=True)
                    for request, result, state in rows
                ),
            )
        return write_jsonl(out, (openai_record(request, result, model=target) for request, result, _ in rows))
