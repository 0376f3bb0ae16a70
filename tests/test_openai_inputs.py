"""OpenAI Batch lines as OpenAI's docs and SDK types write them (issue 10): every field the API defines
is in specq's one table; neutral values are accepted and ignored, supported ones honoured, the others
refused naming the line and the field; fields no endpoint defines stay refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from specq.errors import BadInputError
from specq.jobs.inputs import RequestSpec, iter_request_specs, validate_file
from specq.jobs.openai_fields import BODY_FIELDS, CHAT_URL, COMPLETIONS_URL
from tests.test_inputs import write_lines

# The two lines of OpenAI's Batch guide, byte for byte as it shows them.
BATCH_GUIDE_LINES = [
    '{"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
    '"gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are a helpful assistant."},'
    '{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}',
    '{"custom_id": "request-2", "method": "POST", "url": "/v1/chat/completions", "body": {"model": '
    '"gpt-3.5-turbo-0125", "messages": [{"role": "system", "content": "You are an unhelpful assistant."},'
    '{"role": "user", "content": "Hello world!"}],"max_tokens": 1000}}',
]

CHAT_BODY: chat_create_params.CompletionCreateParamsNonStreaming = {
    "model": "gpt-4o-mini",
    "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "You help."}]},
        {
            "role": "user",
            "name": "ann",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}],
        },
        {"role": "assistant", "content": "Hi.", "tool_calls": [], "refusal": None},
        {"role": "user", "content": "Again"},
    ],
    # neutral: accepted and ignored
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "logit_bias": {"50256": 0},
    "logprobs": False,
    "top_logprobs": 0,
    "n": 1,
    "response_format": {"type": "text"},
    "stream": False,
    "stream_options": None,
    "tools": [],
    "tool_choice": "none",
    "parallel_tool_calls": True,
    "modalities": ["text"],
    "audio": None,
    "prediction": None,
    "reasoning_effort": "none",
    "verbosity": "medium",
    "user": "user-1",
    "metadata": {"batch": "nightly"},
    "store": False,
    "service_tier": "auto",
    "safety_identifier": "s-1",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    # honoured
    "seed": 7,
    "stop": "\n",
    "max_completion_tokens": 16,
    "temperature": 0.5,
    "top_p": 0.9,
}

COMPLETION_BODY: completion_create_params.CompletionCreateParamsNonStreaming = {
    "model": "gpt-3.5-turbo-instruct",
    "prompt": ["Say this is a test"],
    "best_of": 1,
    "echo": False,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "logprobs": None,
    "n": 1,
    "stream": False,
    "stream_options": None,
    "suffix": None,
    "user": "user-1",
    "seed": 1,
    "stop": ["\n\n", "END"],
    "max_tokens": 7,
    "temperature": 0,
    "top_p": 1,
}


def batch_line(custom_id: str, url: str, body: Any) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def defined_fields(params: Any) -> set[str]:
    """The body fields an endpoint defines: those of the `openai` package's request type."""
    return set(params.CompletionCreateParamsNonStreaming.__annotations__)


@pytest.mark.parametrize(
    ("url", "params"), [(COMPLETIONS_URL, completion_create_params), (CHAT_URL, chat_create_params)]
)
def test_the_table_holds_every_field_the_endpoint_defines(url: str, params: Any) -> None:
    table = {name for name, field in BODY_FIELDS.items() if url in field.endpoints}
    assert table - {"top_k"} == defined_fields(params)  # top_k: vLLM's extension


def test_openai_documented_lines_are_accepted(tmp_path: Path) -> None:
    lines: list[object] = [
        *BATCH_GUIDE_LINES,
        batch_line("chat", CHAT_URL, CHAT_BODY),
        batch_line("completion", COMPLETIONS_URL, COMPLETION_BODY),
        batch_line("ids", COMPLETIONS_URL, {"model": "m", "prompt": [5, 6, 7]}),
        batch_line("nested-ids", COMPLETIONS_URL, {"model": "m", "prompt": [[8, 9]], "max_tokens": None}),
    ]
    path = write_lines(tmp_path / "in.jsonl", lines)
    assert validate_file(path) == len(lines)
    guide, _, chat, completion, ids, nested = iter_request_specs(path)
    assert guide.messages == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello world!"},
    ]
    assert guide.overrides == {"max_tokens": 1000}
    assert chat == RequestSpec(
        3,
        "chat",
        "chat",
        None,
        [
            {"role": "system", "content": "Be brief."},  # developer is the system prompt
            {"role": "system", "content": "You help."},
            {"role": "user", "content": "Hello\nworld", "name": "ann"},  # text parts joined as vLLM does
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Again"},
        ],
        {"seed": 7, "stop": ("\n",), "max_tokens": 16, "temperature": 0.5, "top_p": 0.9},
        model="gpt-4o-mini",  # echoed in OpenAI-format output
    )
    assert completion.prompt == "Say this is a test"  # a one-prompt array is that prompt
    assert completion.overrides == {
        "seed": 1,
        "stop": ("\n\n", "END"),
        "max_tokens": 7,
        "temperature": 0.0,
        "top_p": 1.0,
    }
    assert (ids.prompt, ids.prompt_token_ids) == (None, (5, 6, 7))
    assert (nested.prompt_token_ids, nested.overrides) == ((8, 9), {})


# A value specq cannot honour for each field it accepts only at a neutral value.
NOT_NEUTRAL: dict[str, tuple[str, object]] = {
    "stream": (CHAT_URL, True),
    "stream_options": (CHAT_URL, {"include_usage": True}),
    "frequency_penalty": (COMPLETIONS_URL, 0.5),
    "presence_penalty": (CHAT_URL, -1),
    "logit_bias": (CHAT_URL, {"50256": -100}),
    "best_of": (COMPLETIONS_URL, 3),
    "echo": (COMPLETIONS_URL, True),
    "suffix": (COMPLETIONS_URL, "}"),
    "response_format": (CHAT_URL, {"type": "json_object"}),
    "tools": (CHAT_URL, [{"type": "function", "function": {"name": "f"}}]),
    "tool_choice": (CHAT_URL, "required"),
    "functions": (CHAT_URL, [{"name": "f"}]),
    "function_call": (CHAT_URL, {"name": "f"}),
    "modalities": (CHAT_URL, ["text", "audio"]),
    "audio": (CHAT_URL, {"voice": "alloy", "format": "wav"}),
    "prediction": (CHAT_URL, {"type": "content", "content": "x"}),
    "web_search_options": (CHAT_URL, {}),
    "moderation": (CHAT_URL, {"model": "omni-moderation-latest"}),
    "reasoning_effort": (CHAT_URL, "high"),
    "verbosity": (CHAT_URL, "low"),
}


def test_values_specq_cannot_honour_are_refused_naming_line_and_field(tmp_path: Path) -> None:
    assert set(NOT_NEUTRAL) == {name for name, field in BODY_FIELDS.items() if field.use == "neutral"}
    lines: list[object] = []
    for name, (url, value) in NOT_NEUTRAL.items():
        prompt = {"messages": [{"role": "user", "content": "x"}]} if url == CHAT_URL else {"prompt": "x"}
        lines.append(batch_line(name, url, {"model": "m", **prompt, name: value}))
    path = write_lines(tmp_path / "in.jsonl", lines)
    with pytest.raises(BadInputError) as info:
        validate_file(path)
    assert len(info.value.problems) == len(lines)
    for number, (problem, name) in enumerate(zip(info.value.problems, NOT_NEUTRAL, strict=True), start=1):
        value = NOT_NEUTRAL[name][1]
        shown = (
            json.dumps(value)
            if not isinstance(value, list | dict)
            else ("array" if isinstance(value, list) else "object")
        )
        accepted = BODY_FIELDS[name].neutral_text
        assert (
            problem
            == f'{path}:{number}: "body.{name}" is not supported: specq accepts it only as {accepted}, got {shown}'
        )


@pytest.mark.parametrize(
    ("url", "body", "message"),
    [
        (
            CHAT_URL,
            {"messages": [{"role": "user", "content": "x"}], "echo": False},
            '"body.echo" is not a field of /v1/chat/completions',
        ),
        (COMPLETIONS_URL, {"prompt": "x", "metadata": {}}, '"body.metadata" is not a field of /v1/completions'),
        (COMPLETIONS_URL, {"prompt": "x", "min_p": 0.1}, '"body.min_p" is not a field of /v1/completions'),
        (
            CHAT_URL,
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto", "tools": [{"type": "function"}]},
            '"body.tool_choice" is not supported: specq accepts it only as "none" (or "auto" without tools), '
            'got "auto"',
        ),
        (
            CHAT_URL,
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
            '"body.top_logprobs" needs "body.logprobs": true',
        ),
        (
            CHAT_URL,
            {"messages": [{"role": "user", "content": "x"}], "n": 1.0},
            '"body.n" must be an integer, got number',
        ),
    ],
)
def test_fields_and_values_refused(tmp_path: Path, url: str, body: dict, message: str) -> None:
    path = write_lines(tmp_path / "in.jsonl", [batch_line("c", url, body)])
    with pytest.raises(BadInputError) as info:
        validate_file(path)
    assert info.value.problems == [f"{path}:1: {message}"]
