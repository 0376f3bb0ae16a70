"""What specq does with each field of an OpenAI Batch line's body: the one table, `BODY_FIELDS`.

Every field OpenAI's API defines for `/v1/completions` and `/v1/chat/completions` is in it (a test
compares it with the `openai` package's request types), with one of these uses:

- ``prompt``: the request's text (``prompt`` or ``messages``), read by jobs.inputs;
- ``setting``: a generation setting specq honours (``max_tokens``, ``temperature``, ``seed``, ``stop``,
  ...), checked against specq.limits by jobs.inputs;
- ``ignored``: accepted with any value, as it cannot change what a local model generates (``model``,
  ``user``, ``metadata``, ``store``, ``service_tier``, prompt-cache hints, ...);
- ``neutral``: accepted only at the values that change nothing (``frequency_penalty: 0``,
  ``response_format: {"type": "text"}``, ``tools: []``, ``best_of: 1``, ...); any other value is
  refused at submit, naming the line and the field, because specq cannot honour it.

A field the line's endpoint does not define is refused (OpenAI refuses it too), so a typo is reported
instead of being silently ignored. `top_k` is vLLM's extension of both endpoints, honoured as vLLM does.

Switching a field on (as ``logprobs`` was, once the engine returned log-probabilities) is one change:
its entry's use becomes ``setting`` and jobs.inputs reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
BOTH = frozenset({COMPLETIONS_URL, CHAT_URL})
COMPLETIONS_ONLY = frozenset({COMPLETIONS_URL})
CHAT_ONLY = frozenset({CHAT_URL})

FieldUse = Literal["prompt", "setting", "ignored", "neutral"]
Neutral = Callable[[Any, dict], bool]  # (the field's value, the whole body) -> changes nothing


@dataclass(frozen=True)
class BodyField:
    use: FieldUse
    endpoints: frozenset[str]
    neutral: Neutral | None = None  # for use "neutral": whether a value changes nothing
    neutral_text: str = ""  # the neutral values, as the refusal states them


def _null(value: Any, body: dict) -> bool:
    return value is None


def _null_or_false(value: Any, body: dict) -> bool:
    return value is None or value is False  # `is`: 0 == False, and logprobs 0 asks for log-probabilities


def _null_or_zero(value: Any, body: dict) -> bool:
    return value is None or (type(value) in (int, float) and value == 0)


def _null_or_one(value: Any, body: dict) -> bool:
    return value is None or (type(value) is int and value == 1)


def _no_bias(value: Any, body: dict) -> bool:
    return value is None or (isinstance(value, dict) and all(_null_or_zero(v, body) for v in value.values()))


def _null_or_empty(value: Any, body: dict) -> bool:
    return value is None or value == [] or value == ""


def _text_format(value: Any, body: dict) -> bool:
    return value is None or value == {"type": "text"}


def _text_modality(value: Any, body: dict) -> bool:
    return value is None or value == ["text"]


def _one_of(*allowed: str) -> Neutral:
    return lambda value, body: value is None or (isinstance(value, str) and value in allowed)


def _no_call_without(tools_field: str) -> Neutral:
    """`tool_choice` / `function_call`: none, or auto when there is nothing to call."""
    return lambda value, body: value is None or value == "none" or (value == "auto" and not body.get(tools_field))


def _setting(endpoints: frozenset[str] = BOTH) -> BodyField:
    return BodyField("setting", endpoints)


def _ignored(endpoints: frozenset[str] = BOTH) -> BodyField:
    return BodyField("ignored", endpoints)


def _neutral(endpoints: frozenset[str], neutral: Neutral, text: str) -> BodyField:
    return BodyField("neutral", endpoints, neutral, text)


BODY_FIELDS: dict[str, BodyField] = {
    "prompt": BodyField("prompt", COMPLETIONS_ONLY),
    "messages": BodyField("prompt", CHAT_ONLY),
    "max_tokens": _setting(),
    "max_completion_tokens": _setting(CHAT_ONLY),  # chat's name of max_tokens
    "temperature": _setting(),
    "top_p": _setting(),
    "top_k": _setting(),  # vLLM's extension
    "seed": _setting(),
    "stop": _setting(),
    "model": _ignored(),  # the job's target runs every line
    "user": _ignored(),
    "metadata": _ignored(CHAT_ONLY),
    "store": _ignored(CHAT_ONLY),
    "service_tier": _ignored(CHAT_ONLY),
    "safety_identifier": _ignored(CHAT_ONLY),
    "prompt_cache_key": _ignored(CHAT_ONLY),
    "prompt_cache_retention": _ignored(CHAT_ONLY),
    "prompt_cache_options": _ignored(CHAT_ONLY),
    "parallel_tool_calls": _ignored(CHAT_ONLY),  # means nothing without tools, which are refused
    "logprobs": _setting(),  # completions: the top-N count; chat: true or false (jobs.inputs)
    "top_logprobs": _setting(CHAT_ONLY),  # with chat's logprobs: true
    "n": _setting(),  # completions of the line (jobs.inputs)
    # Cannot be honoured by a batch of local text models.
    "stream": _neutral(BOTH, _null_or_false, "false"),
    "stream_options": _neutral(BOTH, _null, "null (it needs stream)"),
    "frequency_penalty": _neutral(BOTH, _null_or_zero, "0"),
    "presence_penalty": _neutral(BOTH, _null_or_zero, "0"),
    "logit_bias": _neutral(BOTH, _no_bias, "null, {} or biases of 0"),
    "best_of": _neutral(COMPLETIONS_ONLY, _null_or_one, "1"),
    "echo": _neutral(COMPLETIONS_ONLY, _null_or_false, "false"),
    "suffix": _neutral(COMPLETIONS_ONLY, _null_or_empty, 'null or ""'),
    "response_format": _neutral(CHAT_ONLY, _text_format, '{"type": "text"}'),
    "tools": _neutral(CHAT_ONLY, _null_or_empty, "[]"),
    "tool_choice": _neutral(CHAT_ONLY, _no_call_without("tools"), '"none" (or "auto" without tools)'),
    "functions": _neutral(CHAT_ONLY, _null_or_empty, "[]"),
    "function_call": _neutral(CHAT_ONLY, _no_call_without("functions"), '"none" (or "auto" without functions)'),
    "modalities": _neutral(CHAT_ONLY, _text_modality, '["text"]'),
    "audio": _neutral(CHAT_ONLY, _null, "null"),
    "prediction": _neutral(CHAT_ONLY, _null, "null"),
    "web_search_options": _neutral(CHAT_ONLY, _null, "null"),
    "moderation": _neutral(CHAT_ONLY, _null, "null"),
    "reasoning_effort": _neutral(CHAT_ONLY, _one_of("none"), '"none"'),
    "verbosity": _neutral(CHAT_ONLY, _one_of("medium"), '"medium" (the default)'),
}

# The fields of a chat message, by role: what specq reads (role, content, name); the rest are tool
# calls and audio, only neutral (null) without tools.
MESSAGE_FIELDS = frozenset({"role", "content", "name"})
MESSAGE_NEUTRAL_FIELDS = frozenset({"tool_calls", "function_call", "audio", "refusal"})
CONTENT_PART_FIELDS = frozenset({"type", "text", "prompt_cache_breakpoint"})  # the last: a cache hint
