"""`specq export`: stream a job's requests and results to a file, in input order, flat in memory.

Rows are read a page at a time by position (keyset pagination on the (job, seq) index), so 1M results
cost what 1k do in memory, and a database restart mid-export resumes at the next page.
Every request of the job has a line; one that never ran (its job was cancelled, or is still waiting)
has no completion and says why in `error` (jsonl, openai) or `status` (csv).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

from sqlalchemy import select

from specq.db.models import Job, Request, Result
from specq.db.session import Database, schema_ready
from specq.errors import JobNotFoundError
from specq.jobs.output_file import open_output
from specq.jobs.outputs import csv_row, openai_record, result_record, write_csv, write_jsonl
from specq.jobs.patience import Patient

ExportFormat = Literal["csv", "jsonl", "openai"]
FORMATS: tuple[ExportFormat, ...] = ("csv", "jsonl", "openai")
PAGE = 1000  # rows read in one statement


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
    logprobs: list[dict[str, Any]] | None = None  # as stored in results.logprobs


def _page(db: Database, job_id: str, after_seq: int) -> list[Any]:
    """Up to PAGE rows of the job's requests after position `after_seq`, with their results."""
    stmt = (
        select(
            Request.seq,
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
            Result.logprobs,
        )
        .outerjoin(Result, Result.request_id == Request.id)
        .where(Request.job_id == job_id, Request.seq > after_seq)
        .order_by(Request.seq)
        .limit(PAGE)
    )
    with db.engine.connect() as conn:
        return list(conn.execute(stmt))


def _rows(
    db: Database, job_id: str, patient: Patient | None
) -> Iterator[tuple[dict[str, Any], StoredResult | None, str]]:
    """(request fields, its result or None, request state) for every request, in input order.

    Read a page at a time, each page after the last position written: a database restart mid-export
    (`patient` rides it out) resumes where it stopped, so even a FIFO gets each line once."""
    after = -1
    while True:
        read = functools.partial(_page, db, job_id, after)
        page = patient(read) if patient else read()
        for row in page:
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
                logprobs=row.logprobs,
            )
            yield request, result, row.status
        if len(page) < PAGE:
            return
        after = page[-1].seq


def _not_run(state: str) -> StoredResult:
    return StoredResult([], "", None, 0, 0, 0, 0, f"the request did not run ({state})")


def _target(db: Database, job_id: str) -> str:
    with db.session() as session:
        job = session.get(Job, job_id) if schema_ready(db) else None
        if job is None:
            raise JobNotFoundError(f"no job has the id {job_id!r}")
        return job.target


def export_job(
    db: Database,
    job_id: str,
    path: str,
    fmt: ExportFormat = "csv",
    *,
    csv_raw: bool = False,
    patient: Patient | None = None,
) -> int:
    """Write the job's results to `path` in `fmt`; returns the number of requests written. CSV text
    cells that a spreadsheet would run get a leading `'` unless `csv_raw` (jobs.outputs.defused).
    `patient`: every read rides out a database outage through it."""
    target = patient(lambda: _target(db, job_id)) if patient else _target(db, job_id)
    rows = _rows(db, job_id, patient)
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
