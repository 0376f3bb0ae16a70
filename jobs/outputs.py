"""Output records: `specq run` lines, `export --format jsonl|csv|openai`.

CSV text cells that a spreadsheet would run as formulas get a leading `'` unless raw (`defused`); JSON
lines are always exact.

One request's output is built from its request (a `RequestSpec`, or a mapping with at least `id`, and
for CSV/OpenAI `kind`, `prompt`, `messages`) and its `GenerationResult`. A failed request has
`completion` and `finish_reason` null and its message in `error`.
"""

from __future__ import annotations

import csv
import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any, Protocol

from specq.jobs.inputs import RequestSpec

CSV_COLUMNS = (
    "id",
    "prompt",
    "completion",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "draft_tokens",
    "accepted_tokens",
    "status",
    "error",
)

RequestLike = RequestSpec | Mapping[str, Any]


class ResultLike(Protocol):
    """What the records read of a result: `decoding.GenerationResult`, or a stored one (jobs.export),
    so that exporting needs no torch."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def draft_tokens(self) -> int: ...
    @property
    def accepted_tokens(self) -> int: ...
    @property
    def error(self) -> str | None: ...
    @property
    def logprobs(self) -> Sequence[Mapping[str, Any]] | None: ...  # decoding.types.TokenLogprob each


def _field(request: RequestLike, name: str) -> Any:
    if isinstance(request, RequestSpec):
        return getattr(request, name)
    return request.get(name)


def result_record(request: RequestLike, result: ResultLike, *, with_tokens: bool = False) -> dict:
    """One line of `specq run`'s output or of `export --format jsonl`.

    `with_tokens` adds `tokens`, the completion's token ids (exactly those `completion` decodes).
    """
    failed = result.error is not None
    record: dict[str, Any] = {
        "id": _field(request, "id"),
        "completion": None if failed else result.text,
        "finish_reason": None if failed else result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "draft_tokens": result.draft_tokens,
        "accepted_tokens": result.accepted_tokens,
    }
    if with_tokens:
        record["tokens"] = None if failed else list(result.token_ids)
    if result.logprobs is not None and not failed:
        record["logprobs"] = list(result.logprobs)
    record["error"] = result.error
    return record


def _hex_id() -> str:
    return uuid.uuid4().hex


def openai_record(request: RequestLike, result: ResultLike | None, *, model: str, created: int | None = None) -> dict:
    """One line of the OpenAI Batch API's output file for `request`.

    `result` None (a request that never ran, e.g. in a cancelled job) and a failed result both give
    `response: null` and an `error` object; `custom_id` is the request's id whatever form its line had.
    """
    line: dict[str, Any] = {"id": f"batch_req_{_hex_id()}", "custom_id": _field(request, "id")}
    if result is None:
        line.update(response=None, error={"code": "not_run", "message": "the request did not run"})
        return line
    if result.error is not None:
        line.update(response=None, error={"code": "generation_failed", "message": result.error})
        return line
    created = int(time.time()) if created is None else created
    usage = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }
    body: dict[str, Any]
    if _field(request, "kind") == "chat":
        body = {
            "id": f"chatcmpl-{_hex_id()}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": result.text},
                    "logprobs": openai_logprobs("chat", result.logprobs),
                    "finish_reason": result.finish_reason,
                }
            ],
            "usage": usage,
        }
    else:
        body = {
            "id": f"cmpl-{_hex_id()}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "text": result.text,
                    "index": 0,
                    "logprobs": openai_logprobs("completion", result.logprobs),
                    "finish_reason": result.finish_reason,
                }
            ],
            "usage": usage,
        }
    line.update(response={"status_code": 200, "request_id": _hex_id(), "body": body}, error=None)
    return line


def openai_logprobs(kind: str, entries: Sequence[Mapping[str, Any]] | None) -> dict[str, Any] | None:
    """A choice's `logprobs` in OpenAI's shape for `kind` ("chat" or "completion"), from the stored
    per-token entries (decoding.types.TokenLogprob); None where the request did not ask.

    Token strings are each id decoded alone, `bytes` their UTF-8 bytes (a token that is part of a
    character decodes to U+FFFD, whose bytes are given); `text_offset` counts characters of the
    completion, from its start, along those token strings."""
    if entries is None:
        return None
    if kind == "chat":

        def alternative(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        content = [
            {
                **alternative(e["token"], e["logprob"]),
                "top_logprobs": [
                    alternative(text, logprob) for text, (_, logprob) in zip(e["top_tokens"], e["top"], strict=True)
                ],
            }
            for e in entries
        ]
        return {"content": content, "refusal": None}
    offsets, offset = [], 0
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        # a dict per token, as OpenAI's; two alternatives with the same text keep the likelier one
        "top_logprobs": [_top_by_text(e) for e in entries],
        "text_offset": offsets,
    }


def _top_by_text(entry: Mapping[str, Any]) -> dict[str, float]:
    top: dict[str, float] = {}
    for text, (_, logprob) in zip(entry["top_tokens"], entry["top"], strict=True):
        top.setdefault(text, logprob)  # likeliest first: a repeated text keeps its likelier logprob
    return top


def prompt_text(request: RequestLike) -> str:
    """The prompt as one string: the text itself, or the JSON of chat messages or of prompt token ids."""
    if _field(request, "kind") == "chat":
        return json.dumps(_field(request, "messages"), ensure_ascii=False)
    if _field(request, "prompt") is None and _field(request, "prompt_token_ids") is not None:
        return json.dumps(_field(request, "prompt_token_ids"))
    return _field(request, "prompt") or ""


def csv_row(request: RequestLike, result: ResultLike | None, status: str) -> list[Any]:
    """One CSV row in CSV_COLUMNS order; `result` None for a request that has none (not run yet)."""
    if result is None:
        return [_field(request, "id"), prompt_text(request), "", "", "", "", "", "", status, ""]
    failed = result.error is not None
    return [
        _field(request, "id"),
        prompt_text(request),
        "" if failed else result.text,
        "" if failed else result.finish_reason,
        result.prompt_tokens,
        result.completion_tokens,
        result.draft_tokens,
        result.accepted_tokens,
        status,
        result.error or "",
    ]


def csv_writer(out: IO[str]) -> Any:
    """A csv writer with RFC 4180 quoting; open `out` with `newline=""` and `encoding="utf-8"`."""
    return csv.writer(out, lineterminator="\r\n", quoting=csv.QUOTE_MINIMAL)


# A spreadsheet runs a cell that begins with one of these as a formula (a tab or a carriage return can
# hide one behind them); completions and prompts are untrusted text
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def defused(cell: Any) -> Any:
    """A text cell that a spreadsheet would run, with a leading `'` (OWASP's CSV-injection defence, as
    spreadsheets show it: the text, not a formula); other cells, numbers included, as they are."""
    return "'" + cell if isinstance(cell, str) and cell.startswith(FORMULA_STARTS) else cell


def write_csv(out: IO[str], rows: Iterable[list[Any]], *, raw: bool = False) -> int:
    """Write the header and `rows` (from csv_row); returns the number of rows. Text cells are `defused`
    unless `raw`, which keeps every cell exactly (the RFC 4180 round trip)."""
    writer = csv_writer(out)
    writer.writerow(CSV_COLUMNS)
    count = 0
    for row in rows:
        writer.writerow(row if raw else [defused(cell) for cell in row])
        count += 1
    return count


def write_jsonl(out: IO[str], records: Iterable[dict]) -> int:
    """Write one JSON object a line (UTF-8 text, not \\u-escaped); returns the number of lines."""
    count = 0
    for record in records:
        out.write(json.dumps(record, ensure_ascii=False))
        out.write("\n")
        count += 1
    return count
