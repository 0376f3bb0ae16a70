"""Output records: run/jsonl lines, OpenAI Batch lines, CSV that any text survives."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace

from specq.decoding.types import GenerationResult
from specq.jobs.inputs import RequestSpec
from specq.jobs.outputs import (
    CSV_COLUMNS,
    OpenAIIds,
    csv_row,
    openai_record,
    result_record,
    write_csv,
    write_jsonl,
)

IDS = OpenAIIds.derive("job", 0)

COMPLETION = RequestSpec(1, "q1", "completion", "def add(a, b):", None, {})
CHAT = RequestSpec(2, "c1", "chat", None, [{"role": "user", "content": "hi"}], {"max_tokens": 4})


def ok(text: str = " return a + b", finish: str = "stop") -> GenerationResult:
    return GenerationResult(
        key=1,
        token_ids=[5, 6, 7],
        text=text,
        finish_reason=finish,  # type: ignore[arg-type]
        prompt_tokens=6,
        completion_tokens=3,
        draft_tokens=8,
        accepted_tokens=5,
        seed=1,
        latency_s=0.2,
    )


def failed() -> GenerationResult:
    return GenerationResult(
        key=1,
        token_ids=[],
        text="",
        finish_reason=None,
        prompt_tokens=5000,
        completion_tokens=0,
        error="prompt has 5000 tokens; the target's context is 2048",
    )


def test_result_record_fields() -> None:
    assert result_record(COMPLETION, ok()) == {
        "id": "q1",
        "completion": " return a + b",
        "finish_reason": "stop",
        "prompt_tokens": 6,
        "completion_tokens": 3,
        "draft_tokens": 8,
        "accepted_tokens": 5,
        "error": None,
    }
    with_tokens = result_record({"id": "q1"}, ok(finish="length"), with_tokens=True)
    assert with_tokens["tokens"] == [5, 6, 7]
    assert with_tokens["finish_reason"] == "length"


def test_result_record_failed() -> None:
    record = result_record(COMPLETION, failed(), with_tokens=True)
    assert record["completion"] is None
    assert record["finish_reason"] is None
    assert record["tokens"] is None
    assert record["error"] == "prompt has 5000 tokens; the target's context is 2048"


def test_openai_completion_line() -> None:
    line = openai_record(COMPLETION, ok(), model="tgt", ids=IDS, created=123)
    assert line["id"].startswith("batch_req_")
    assert line["custom_id"] == "q1"
    assert line["error"] is None
    response = line["response"]
    assert response["status_code"] == 200 and response["request_id"]
    body = response["body"]
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == "tgt" and body["created"] == 123
    assert body["choices"] == [{"text": " return a + b", "index": 0, "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
    json.dumps(line)  # serialisable as it is


def test_openai_chat_line_from_mapping() -> None:
    request = {"id": "c1", "kind": "chat", "messages": [{"role": "user", "content": "hi"}]}
    body = openai_record(request, ok(text="hello"), model="tgt", ids=IDS)["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert isinstance(body["created"], int)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello", "refusal": None}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["total_tokens"] == 9


def test_openai_failed_and_not_run() -> None:
    line = openai_record(CHAT, failed(), model="tgt", ids=IDS)
    assert line["response"] is None
    assert line["error"] == {
        "code": "generation_failed",
        "message": "prompt has 5000 tokens; the target's context is 2048",
    }
    line = openai_record(CHAT, None, model="tgt", ids=IDS, state="queued")
    assert line["response"] is None and line["error"]["code"] == "not_run"
    assert line["custom_id"] == "c1"
    for state, code in (("cancelled", "batch_cancelled"), ("expired", "batch_expired")):
        assert openai_record(CHAT, None, model="tgt", ids=IDS, state=state)["error"]["code"] == code


def test_a_prompt_past_the_context_is_a_400_as_openai_answers_it() -> None:
    message = "prompt (5000 tokens) plus max_tokens (16) exceeds the model's context of 2048 tokens"
    for request, param in ((CHAT, "messages"), (COMPLETION, "prompt")):
        line = openai_record(request, replace(failed(), error=message), model="tgt", ids=IDS)
        assert line["error"] is None
        assert line["response"]["status_code"] == 400
        assert line["response"]["body"] == {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": param,
                "code": "context_length_exceeded",
            }
        }


def test_openai_ids_are_stable_and_distinct() -> None:
    assert OpenAIIds.derive("job", 3) == OpenAIIds.derive("job", 3)
    ids = {OpenAIIds.derive(job, seq) for job in ("a", "b") for seq in range(50)}
    assert len(ids) == 100
    assert IDS.line.startswith("batch_req_") and len(set(IDS)) == 3


def test_openai_bodies_validate_with_the_openai_types() -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    body = openai_record(COMPLETION, ok(), model="tgt", ids=IDS, created=1)["response"]["body"]
    assert Completion.model_validate(body).choices[0].text == " return a + b"
    body = openai_record(CHAT, ok(text="hi"), model="tgt", ids=IDS, created=1)["response"]["body"]
    assert ChatCompletion.model_validate(body).choices[0].message.content == "hi"


NASTY = [
    'quote " and ""double""',
    "comma, and; semicolon",
    "new\nline and\r\nCRLF and lone \r",
    "unicode: h\u00e9llo \u2603 \U0001f600 \u202eRTL",
    "   leading and trailing spaces   ",
    "",
    "tab\tand back\\slash",
]


def test_csv_round_trip_of_nasty_text() -> None:
    buf = io.StringIO(newline="")
    rows = [
        csv_row({"id": f"id,{i}\n", "kind": "completion", "prompt": t}, ok(text=t), "completed")
        for i, t in enumerate(NASTY)
    ]
    rows.append(csv_row(CHAT, failed(), "failed"))
    rows.append(csv_row(COMPLETION, None, "cancelled"))
    assert write_csv(buf, rows) == len(NASTY) + 2
    raw = buf.getvalue().encode("utf-8")
    assert raw.startswith(b"id,prompt,completion,finish_reason,prompt_tokens,")
    assert raw.endswith(b"\r\n")

    read = list(csv.reader(io.StringIO(raw.decode("utf-8"), newline="")))
    assert tuple(read[0]) == CSV_COLUMNS
    for i, text in enumerate(NASTY):
        row = dict(zip(CSV_COLUMNS, read[1 + i], strict=True))
        assert row["id"] == f"id,{i}\n"
        assert row["prompt"] == text
        assert row["completion"] == text
        assert row["finish_reason"] == "stop"
        assert (row["prompt_tokens"], row["completion_tokens"]) == ("6", "3")
        assert (row["draft_tokens"], row["accepted_tokens"]) == ("8", "5")
        assert (row["status"], row["error"]) == ("completed", "")
    chat = dict(zip(CSV_COLUMNS, read[-2], strict=True))
    assert json.loads(chat["prompt"]) == CHAT.messages
    assert (chat["completion"], chat["finish_reason"], chat["status"]) == ("", "", "failed")
    assert chat["error"].startswith("prompt has 5000 tokens")
    cancelled = dict(zip(CSV_COLUMNS, read[-1], strict=True))
    assert cancelled["status"] == "cancelled" and cancelled["completion"] == ""


def test_jsonl_writes_unicode_unescaped() -> None:
    buf = io.StringIO()
    assert write_jsonl(buf, [result_record(COMPLETION, ok(text='\u2603\n"'))]) == 1
    text = buf.getvalue()
    assert "\u2603" in text and text.endswith("\n") and text.count("\n") == 1
    assert json.loads(text)["completion"] == '\u2603\n"'


FORMULAS = ["=1+1", "+SUM(A1)", "-2+3", "@cmd", "\t=hidden", "\r=hidden", '=HYPERLINK("http://x")']
HARMLESS = ["1+1", " =spaced", "'quoted", "a=b", ""]


def _csv_rows(raw: bool) -> list[dict[str, str]]:
    buf = io.StringIO(newline="")
    rows = [
        csv_row({"id": text, "kind": "completion", "prompt": text}, ok(text=text), "completed")
        for text in FORMULAS + HARMLESS
    ]
    rows.append(csv_row(COMPLETION, replace(failed(), error="-oops"), "failed"))
    write_csv(buf, rows, raw=raw)
    read = list(csv.reader(io.StringIO(buf.getvalue(), newline="")))
    return [dict(zip(CSV_COLUMNS, row, strict=True)) for row in read[1:]]


def test_csv_defuses_formulas_by_default() -> None:
    rows = _csv_rows(raw=False)
    for row, text in zip(rows, FORMULAS + HARMLESS, strict=False):
        expected = "'" + text if text in FORMULAS else text
        assert (row["id"], row["prompt"], row["completion"]) == (expected, expected, expected)
        # numbers and the fixed words are untouched
        assert (row["prompt_tokens"], row["completion_tokens"], row["draft_tokens"]) == ("6", "3", "8")
        assert (row["accepted_tokens"], row["finish_reason"], row["status"]) == ("5", "stop", "completed")
    assert rows[-1]["error"] == "'-oops"


def test_csv_raw_keeps_every_cell_exactly() -> None:
    rows = _csv_rows(raw=True)
    for row, text in zip(rows, FORMULAS + HARMLESS, strict=False):
        assert (row["id"], row["prompt"], row["completion"]) == (text, text, text)
    assert rows[-1]["error"] == "-oops"


def test_jsonl_keeps_formulas_exactly() -> None:
    buf = io.StringIO()
    write_jsonl(buf, [result_record(COMPLETION, ok(text=text)) for text in FORMULAS])
    assert [json.loads(line)["completion"] for line in buf.getvalue().splitlines()] == FORMULAS
