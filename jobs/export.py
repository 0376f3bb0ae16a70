"""`specq export`: stream a job's requests and results to a file, in input order, flat in memory.

Rows are read a page at a time by position (keyset pagination on the (job, seq) index), so 1M results
cost what 1k do in memory, and a database restart mid-export resumes at the next page.
Every request of the job has a line; one that never ran (its job was cancelled, or is still waiting)
has no completion and says why in `error` (jsonl, openai) or `status` (csv).

A job deleted while it streams (`specq delete`, retention) is noticed: the rows run out before the
job's total, and export fails (exit 1) instead of saying it wrote them all; a file is then left as it
was (it is replaced only once complete), a FIFO or device has what was written.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple

from sqlalchemy import select

from specq.db.models import Job, Request, Result
from specq.db.session import Database, schema_ready
from specq.errors import JobNotFoundError, SpecqError
from specq.jobs.output_file import open_output
from specq.jobs.outputs import OpenAIIds, csv_row, openai_record, result_record, served_name, write_csv, write_jsonl
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
    logprobs: list[dict[str, Any]] | None = None  # TokenLogprob.to_dict() of each token, when asked


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
            Request.model,
            Request.line,
            Request.choice_index,
            Result.completion,
            Result.token_ids,
            Result.finish_reason,
            Result.prompt_tokens,
            Result.completion_tokens,
            Result.draft_tokens,
            Result.accepted_tokens,
            Result.error,
            Result.logprobs,
            Result.status,
            Result.created_at,
        )
        .outerjoin(Result, Result.request_id == Request.id)
        .where(Request.job_id == job_id, Request.seq > after_seq)
        .order_by(Request.seq)
        .limit(PAGE)
    )
    with db.engine.connect() as conn:
        return list(conn.execute(stmt))


class Row(NamedTuple):
    """One request of the job as export reads it."""

    seq: int
    line: int  # the input line: a line with `n` > 1 has a row a choice, consecutive
    choice: int
    request: dict[str, Any]
    result: StoredResult | None  # None: it has not run
    state: str  # the result's status when it has one, else the request's state
    created: int | None  # when the result was stored, epoch seconds


def _rows(db: Database, job_id: str, total: int, patient: Patient | None) -> Iterator[Row]:
    """Every request of the job with its result, in input order; SpecqError if they run out before
    `total` (the job was deleted meanwhile).

    Read a page at a time, each page after the last position written: a database restart mid-export
    (`patient` rides it out) resumes where it stopped, so even a FIFO gets each line once."""
    after, read_so_far = -1, 0
    while True:
        read = functools.partial(_page, db, job_id, after)
        page = patient(read) if patient else read()
        read_so_far += len(page)
        for row in page:
            request = {
                "id": row.custom_id,
                "kind": row.kind,
                "prompt": row.prompt,
                "messages": row.messages,
                "prompt_token_ids": row.prompt_token_ids,
                "model": row.model,
            }
            if row.status is None:
                yield Row(row.seq, row.line, row.choice_index, request, None, row.state, None)
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
            yield Row(row.seq, row.line, row.choice_index, request, result, row.status, int(row.created_at.timestamp()))
        if len(page) < PAGE:
            if read_so_far < total:
                raise SpecqError(
                    f"job {job_id} was deleted while it was exported ({read_so_far} of its {total} requests "
                    "read): the output is incomplete"
                )
            return
        after = page[-1].seq


def _not_run(state: str) -> StoredResult:
    return StoredResult([], "", None, 0, 0, 0, 0, f"the request did not run ({state})")


def _job(db: Database, job_id: str) -> Job:
    with db.session() as session:
        job = session.get(Job, job_id) if schema_ready(db) else None
        if job is None:
            raise JobNotFoundError(f"no job has the id {job_id!r}")
        session.expunge(job)
        return job


Only = Literal["completed", "errors"] | None


def _lines(rows: Iterator[Row]) -> Iterator[list[Row]]:
    """The rows of each input line: one, or its `n` choices."""
    for _, choices in itertools.groupby(rows, key=lambda row: row.line):
        yield list(choices)


def _wanted(choices: list[Row], only: Only) -> bool:
    """--completed-only: OpenAI's output file; --errors-only: its error file (every other line). A line
    completed when every one of its choices did."""
    if only is None:
        return True
    return all(row.state == "completed" for row in choices) == (only == "completed")


def export_job(
    db: Database,
    job_id: str,
    path: str,
    fmt: ExportFormat = "csv",
    *,
    csv_raw: bool = False,
    only: Only = None,
    patient: Patient | None = None,
) -> int:
    """Write the job's results to `path` in `fmt`; returns the number of lines written (csv and jsonl:
    a line with `n` > 1 writes a row a choice). CSV text cells that a spreadsheet would run get a
    leading `'` unless `csv_raw` (jobs.outputs.defused). `only`: just the completed lines, or just the
    others. `patient`: every read rides out a database outage through it.

    In the OpenAI format, `model` is the job's served model name, else the line's `body.model`, else the
    target's name (`served_name`); ids derive from the job id and the line's first position."""
    job = patient(lambda: _job(db, job_id)) if patient else _job(db, job_id)
    default_model = served_name(job.target)
    lines = (choices for choices in _lines(_rows(db, job_id, job.total, patient)) if _wanted(choices, only))
    # csv and jsonl: a row a choice, which says its index when the line has several
    rows = ((row, row.choice if len(choices) > 1 else None) for choices in lines for row in choices)
    with open_output(path) as out:
        if fmt == "csv":
            return write_csv(
                out, (csv_row(row.request, row.result, row.state, choice or 0) for row, choice in rows), raw=csv_raw
            )
        if fmt == "jsonl":
            return write_jsonl(
                out,
                (
                    result_record(row.request, row.result or _not_run(row.state), with_tokens=True, choice=choice)
                    for row, choice in rows
                ),
            )
        return write_jsonl(
            out,
            (
                openai_record(
                    choices[0].request,
                    choices[0].result,
                    model=job.served_model_name or choices[0].request["model"] or default_model,
                    ids=OpenAIIds.derive(job_id, choices[0].seq),
                    created=max((row.created for row in choices if row.created is not None), default=None),
                    state=choices[0].state,
                    more=[row.result for row in choices[1:]],
                    more_states=[row.state for row in choices[1:]],
                )
                for choices in lines
            ),
        )
