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
import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any, NamedTuple, Protocol

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
    "choice",  # 0, or which of a line's n completions (`n` > 1: a row each)
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
    def logprobs(self) -> Sequence[Any] | None: ...  # TokenLogprob objects, or their dicts as stored


def logprob_entries(result: ResultLike) -> list[dict[str, Any]] | None:
    """The result's per-token log-probabilities as dicts (TokenLogprob.to_dict()); None if not asked."""
    if result.logprobs is None:
        return None
    return [entry if isinstance(entry, dict) else entry.to_dict() for entry in result.logprobs]


def openai_completion_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """/v1/completions' `choices[i].logprobs`: tokens, their logprobs, each one's top alternatives
    (token -> logprob) and its offset in the completion's text."""
    offsets, offset = [], 0
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {
        "tokens": [entry["token"] for entry in entries],
        "token_logprobs": [entry["logprob"] for entry in entries],
        "top_logprobs": [{token: logprob for _, token, logprob in entry["top"]} for entry in entries],
        "text_offset": offsets,
    }


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="surrogatepass"))


def openai_chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Chat's `choices[i].logprobs`: `content`, one object a token with its bytes and top alternatives."""
    return {
        "content": [
            {
                "token": entry["token"],
                "logprob": entry["logprob"],
                "bytes": _token_bytes(entry["token"]),
                "top_logprobs": [
                    {"token": token, "logprob": logprob, "bytes": _token_bytes(token)}
                    for _, token, logprob in entry["top"]
                ],
            }
            for entry in entries
        ],
        "refusal": None,
    }


def _field(request: RequestLike, name: str) -> Any:
    if isinstance(request, RequestSpec):
        return getattr(request, name)
    return request.get(name)


def result_record(
    request: RequestLike, result: ResultLike, *, with_tokens: bool = False, choice: int | None = None
) -> dict:
    """One line of `specq run`'s output or of `export --format jsonl`.

    `with_tokens` adds `tokens`, the completion's token ids (exactly those `completion` decodes);
    `choice` (a line with `n` > 1, a record each) adds which of its completions this is.
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
    entries = None if failed else logprob_entries(result)
    if entries is not None:
        record["logprobs"] = [{k: entry[k] for k in ("token", "logprob", "top")} for entry in entries]
    record["error"] = result.error
    if choice is not None:
        record["choice"] = choice
    return record


# OpenAI's error codes for a request that has no result: its job was cancelled before it ran, or its
# completion window ended first. Any other state (queued, running) is a job still under way.
NOT_RUN_CODES = {"cancelled": "batch_cancelled", "expired": "batch_expired"}
# The engine's message for a prompt that cannot fit (decoding.engine): OpenAI answers it with a 400
CONTEXT_OVERFLOW = "exceeds the model's context"


class OpenAIIds(NamedTuple):
    """The ids of one output line: derived from the job (or run) and the request's position, so every
    export of a job gives the same ids."""

    line: str  # the output line's `id`
    request: str  # `response.request_id`
    completion: str  # `response.body.id`, without its `cmpl-` / `chatcmpl-` prefix

    @classmethod
    def derive(cls, scope: str, position: int) -> OpenAIIds:
        def one(part: str) -> str:
            return uuid.uuid5(uuid.NAMESPACE_URL, f"specq:{scope}:{position}:{part}").hex

        return cls(f"batch_req_{one('line')}", one("request"), one("completion"))


def _response(ids: OpenAIIds, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"status_code": status_code, "request_id": ids.request, "body": body}


def _choice(chat: bool, index: int, result: ResultLike) -> dict[str, Any]:
    entries = logprob_entries(result)
    if chat:
        message = {"role": "assistant", "content": result.text, "refusal": None}
        logprobs = None if entries is None else openai_chat_logprobs(entries)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": result.finish_reason}
    return {
        "text": result.text,
        "index": index,
        "logprobs": None if entries is None else openai_completion_logprobs(entries),
        "finish_reason": result.finish_reason,
    }


def _completion_body(
    request: RequestLike, choices: Sequence[tuple[int, ResultLike]], *, ids: OpenAIIds, model: str, created: int
) -> dict:
    """The response body of a line and its completions (one, or `n`: each (index, result)): the prompt
    counted once in the usage, the completions' tokens summed, as OpenAI counts them."""
    prompt_tokens = choices[0][1].prompt_tokens
    completion_tokens = sum(result.completion_tokens for _, result in choices)
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    chat = _field(request, "kind") == "chat"
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{ids.completion}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [_choice(chat, index, result) for index, result in choices],
        "usage": usage,
    }


def openai_record(
    request: RequestLike,
    result: ResultLike | None,
    *,
    model: str,
    ids: OpenAIIds,
    created: int | None = None,
    state: str = "",
    more: Sequence[ResultLike | None] = (),
    more_states: Sequence[str] = (),
) -> dict:
    """One line of the OpenAI Batch API's output file for `request` (its error file for a request
    without a completion).

    `model` is the name to report (jobs.export picks it: `--served-model-name`, else the line's
    `body.model`, else the target's name); `created` the result's time (epoch seconds). `result` None: a
    request that never ran, with `state` its request state (`batch_cancelled`, `batch_expired`). A
    prompt too long for the model is a 400 `invalid_request_error` response, as OpenAI answers one; any
    other failure an `error` object. `custom_id` is the request's id whatever form its line had.

    `more`: the results of the line's other choices (`n` > 1), with their request states (`more_states`),
    which join `result` as `choices[1:]`. A line completed only if every choice did; one none of whose
    choices completed is the first choice's error; one partly run (cancelled, expired, some choices
    failed) keeps what completed: a 200 response with those choices (each with its own index) and an
    `error` saying how many were cut and why. It is not a completed line (`--errors-only` has it).
    """
    if more:
        results = [result, *more]
        states = [state, *more_states, *[""] * (len(more) - len(more_states))]
        done = [(i, r) for i, r in enumerate(results) if r is not None and r.error is None]
        cut = [i for i, r in enumerate(results) if r is None or r.error is not None]
        if cut and not done:
            return openai_record(request, result, model=model, ids=ids, created=created, state=state)
        record = _completed_line(request, done, model=model, ids=ids, created=created)
        if cut:
            first = results[cut[0]]
            if first is None:
                code, why = NOT_RUN_CODES.get(states[cut[0]], "not_run"), f"did not run ({states[cut[0]]})"
            else:
                code, why = "generation_failed", f"failed: {first.error}"
            message = f"{len(cut)} of {len(results)} choices did not complete; the first {why}"
            record["error"] = {"code": code, "message": message}
        return record
    line: dict[str, Any] = {"id": ids.line, "custom_id": _field(request, "id")}
    if result is None:
        code = NOT_RUN_CODES.get(state, "not_run")
        message = f"the request did not run ({state})" if state else "the request did not run"
        line.update(response=None, error={"code": code, "message": message})
        return line
    if result.error is not None and CONTEXT_OVERFLOW in result.error:
        param = "messages" if _field(request, "kind") == "chat" else "prompt"
        error = {
            "message": result.error,
            "type": "invalid_request_error",
            "param": param,
            "code": "context_length_exceeded",
        }
        line.update(response=_response(ids, 400, {"error": error}), error=None)
        return line
    if result.error is not None:
        line.update(response=None, error={"code": "generation_failed", "message": result.error})
        return line
    return _completed_line(request, [(0, result)], model=model, ids=ids, created=created)


def _completed_line(
    request: RequestLike,
    choices: Sequence[tuple[int, ResultLike]],
    *,
    model: str,
    ids: OpenAIIds,
    created: int | None,
) -> dict:
    """A line with a 200 response holding `choices` (index, result)."""
    created = int(time.time()) if created is None else created
    body = _completion_body(request, choices, ids=ids, model=model, created=created)
    return {"id": ids.line, "custom_id": _field(request, "id"), "response": _response(ids, 200, body), "error": None}


def served_name(target: str) -> str:
    """The target as OpenAI output names it: a hub id as it is, a local folder by its last component
    (a path of the machine that ran it means nothing to the reader, and may say too much)."""
    if target.startswith(("/", "./", "../", "~")) or os.path.isdir(target):
        return os.path.basename(os.path.normpath(target)) or target
    return target


def prompt_text(request: RequestLike) -> str:
    """The prompt as one string: the text itself, or the JSON of chat messages or of prompt token ids."""
    if _field(request, "kind") == "chat":
        return json.dumps(_field(request, "messages"), ensure_ascii=False)
    if _field(request, "prompt") is None and _field(request, "prompt_token_ids") is not None:
        return json.dumps(_field(request, "prompt_token_ids"))
    return _field(request, "prompt") or ""


def csv_row(request: RequestLike, result: ResultLike | None, status: str, choice: int = 0) -> list[Any]:
    """One CSV row in CSV_COLUMNS order; `result` None for a request that has none (not run yet)."""
    if result is None:
        return [_field(request, "id"), prompt_text(request), "", "", "", "", "", "", status, "", choice]
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
        choice,
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
