"""Parse and validate a JSONL input file of requests, streaming, one line at a time.

Each non-blank line is one request, in either form (mixed freely):

- plain: ``{"id": "q1", "prompt": "...", "max_tokens": 64, ...}``. ``id`` may be left out: it is then the
  1-based line number, as a string. A plain line may carry ``messages`` instead of ``prompt`` (a chat
  request, rendered with the target's chat template). Unknown keys are errors, so a typo such as
  ``max_token`` is reported instead of being silently ignored.
- OpenAI Batch API: ``{"custom_id": "q1", "method": "POST", "url": "/v1/completions" or
  "/v1/chat/completions", "body": {...}}``; the prompt (or ``messages``) and the settings are read from
  ``body``. Every body field the endpoint defines is accepted: what specq does with each (honour it,
  ignore it, or accept only its neutral value) is the table of jobs.openai_fields. A field the endpoint
  does not define is an error.

Prompts: a completion ``prompt`` is a string or token ids, or an array of one of them (several prompts
are refused: put each on its own line). Chat ``messages`` have a ``role`` (``developer`` is read as
``system``; ``tool`` and ``function`` are refused), a ``content`` that is a string or an array of
``{"type": "text"}`` parts (joined with newlines, as vLLM does), and may have a ``name``.

Decisions, so callers and users can rely on them:

- An id (``id`` or ``custom_id``) is a non-empty string or an integer (not a boolean); an integer is
  turned into its decimal string, so ``7`` and ``"7"`` are the same id. Ids are unique within a file,
  across both forms; a repeat is an error on the later line, naming the first.
- A blank (whitespace-only) line is skipped but still counts for line numbers, so ``LINE`` is always
  the line number an editor shows.
- An override set to ``null`` counts as not set (the OpenAI API allows ``null`` for them).
- Ranges are specq.limits': ``max_tokens`` an integer in [1, 1,000,000] (the model's context is checked
  later, per request), ``temperature`` a number in [0, 2] (OpenAI's range; one below
  ``MIN_SAMPLING_TEMPERATURE``, 1e-5, is decoded greedily, as 0), ``top_p`` in (0, 1], ``top_k``
  an integer in [0, 2**31 - 1], ``seed`` an integer in [0, 2**63), ``stop`` a non-empty string or a
  list of at most 4 of them. Booleans are not numbers.
- Prompts, message contents and names are non-empty strings; NUL characters and lone surrogates are
  refused because the results store cannot hold them. Token ids are integers in [0, 2**31 - 1].

Every bad line is reported, as ``INPUT:LINE: what is wrong`` (INPUT is the path as the user gave it), in
one ``BadInputError`` raised once the whole file has been read.

Limits (``InputLimits``): a line may hold at most ``max_line_bytes`` (1 MiB by default); a longer one is
reported like any bad line, and is never read into memory whole. A file larger than ``max_file_bytes``
(4 GiB by default) is refused before its first line is read. Both are set with ``SPECQ_MAX_LINE_BYTES``
and ``SPECQ_MAX_INPUT_BYTES`` or the commands' ``--max-line-bytes`` and ``--max-input-bytes``.

Memory stays flat in the number of lines: duplicate ids are found from an 8-byte hash per line, sorted
once at the end; only when some hash repeats is the file read again, to compare those ids themselves.
"""

from __future__ import annotations

import json
import math
import os
import sys
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson

from specq.decoding.types import SAMPLING_KEYS
from specq.errors import BadInputError
from specq.jobs.openai_fields import (
    BODY_FIELDS,
    CHAT_URL,
    COMPLETIONS_URL,
    CONTENT_PART_FIELDS,
    MESSAGE_FIELDS,
    MESSAGE_NEUTRAL_FIELDS,
)
from specq.limits import (
    CHOICES,
    COMPLETIONS_LOGPROBS,
    INPUT_BYTES,
    LINE_BYTES,
    LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_TOKENS,
    SEED,
    TEMPERATURE,
    TOKEN_ID,
    TOP_K,
    TOP_P,
    Limit,
)

RequestKind = Literal["completion", "chat"]

# role -> the role the chat template sees: OpenAI's `developer` is the system prompt of newer models
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
TOOL_ROLES = frozenset({"tool", "function"})
_ROLES_TEXT = ", ".join(f'"{role}"' for role in CHAT_ROLES)

_OVERRIDE_SET = frozenset(SAMPLING_KEYS)
_PLAIN_KEYS = frozenset({"id", "prompt", "messages", "logprobs", "n", *SAMPLING_KEYS})
_OPENAI_KEYS = frozenset({"custom_id", "method", "url", "body"})
_MESSAGE_KEYS = MESSAGE_FIELDS | MESSAGE_NEUTRAL_FIELDS
MAX_LINE_ENV = "SPECQ_MAX_LINE_BYTES"
MAX_INPUT_ENV = "SPECQ_MAX_INPUT_BYTES"
# `keys() <= frozenset` compares without building a set: the checks below run once per line


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One validated request line.

    `overrides` holds only the generation settings the line set, normalised: `temperature` and `top_p`
    are floats, `stop` is a tuple of strings.
    """

    line: int  # 1-based line number in the input file
    id: str  # `id` or `custom_id`, or the line number when a plain line has none
    kind: RequestKind
    prompt: str | None  # set for "completion" requests given as text
    messages: list[dict] | None  # set for "chat" requests: [{"role": ..., "content": ..., "name"?}, ...]
    overrides: dict
    # set for "completion" requests given as token ids, and for "chat" requests once rendered (at submit)
    prompt_token_ids: tuple[int, ...] | None = None
    model: str | None = None  # an OpenAI line's `body.model`, echoed in OpenAI-format output
    n: int = 1  # completions of this line (`n`), each a request of its own (`choice_index`)


@dataclass(frozen=True)
class InputLimits:
    # a prompt of a 128k-token context is about 512 KB of text: 1 MiB a line leaves room for that and
    # refuses a file with no newlines (or a binary file) before it fills the memory
    max_line_bytes: int = 1 << 20
    # 1M requests of about 4 KB each; past this a file is more likely a mistake than a batch
    max_file_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        LINE_BYTES.check("max_line_bytes", self.max_line_bytes)
        INPUT_BYTES.check("max_file_bytes", self.max_file_bytes)

    @classmethod
    def from_env(cls, max_line_bytes: int | None = None, max_file_bytes: int | None = None) -> InputLimits:
        """The given limits, else SPECQ_MAX_LINE_BYTES / SPECQ_MAX_INPUT_BYTES, else the defaults."""
        values: dict[str, int] = {}
        for field_name, given, env in (
            ("max_line_bytes", max_line_bytes, MAX_LINE_ENV),
            ("max_file_bytes", max_file_bytes, MAX_INPUT_ENV),
        ):
            raw = given if given is not None else os.environ.get(env)
            if raw is not None and raw != "":
                values[field_name] = int(raw)
        return cls(**values)


class LineError(ValueError):
    """What is wrong with one line; the caller adds `INPUT:LINE: `."""


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


MAX_ECHO_CHARS = 80  # of a value a message quotes from the line


def _echo(value: Any) -> str:
    """A value of the line as a message quotes it: JSON (a newline or a quote in a string cannot forge
    another `INPUT:LINE:` line of the report), cut to MAX_ECHO_CHARS; an array or object by its type."""
    if isinstance(value, list | dict):
        return _type_name(value)
    text = json.dumps(value)
    return text if len(text) <= MAX_ECHO_CHARS else text[: MAX_ECHO_CHARS - 3] + "..."


def _first_key(keys: Any, prefix: str = "") -> str:
    """The first (sorted) of a line's offending `keys`, quoted, with its `prefix` ("body.")."""
    return _echo(prefix + sorted(keys)[0])


def _check_text(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise LineError(f'"{name}" must be a string, got {_type_name(value)}')
    if not value:
        raise LineError(f'"{name}" must not be empty')
    if "\x00" in value:
        raise LineError(f'"{name}" contains a NUL character, which cannot be stored')
    if not value.isascii():  # isascii is a flag check; encoding is only needed for non-ASCII text
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise LineError(f'"{name}" contains a lone surrogate (invalid Unicode)') from None
    return value


def _check_id(name: str, value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise LineError(f'"{name}" must be a string or an integer, got {_type_name(value)}')
    return _check_text(name, value)


def _check_int(name: str, value: Any, limit: Limit) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise LineError(f'"{name}" must be an integer, got {_type_name(value)}')
    _check_range(name, value, value, limit)
    return value


def _check_range(name: str, number: float, value: Any, limit: Limit) -> None:
    """`number` is `value` as checked; the message shows `value` as the line wrote it."""
    if number not in limit:
        raise LineError(f'"{name}" must be {limit.text()}, got {_echo(value)}')


def _check_number(name: str, value: Any, limit: Limit) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise LineError(f'"{name}" must be a number, got {_type_name(value)}')
    if isinstance(value, float) and not math.isfinite(value):
        raise LineError(f'"{name}" must be a finite number, got {value}')
    _check_range(name, value, value, limit)  # before float(): an integer past 1e308 does not convert
    return float(value)


def _check_stop(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return (_check_text(name, value),)
    items = value
    if not isinstance(items, list):
        raise LineError(f'"{name}" must be a string or an array of strings, got {_type_name(value)}')
    if not 1 <= len(items) <= MAX_STOP_STRINGS:
        raise LineError(f'"{name}" must hold 1 to {MAX_STOP_STRINGS} strings, got {len(items)}')
    return tuple(_check_text(f"{name}[{i}]", item) for i, item in enumerate(items))


_INT_LIMITS = {"max_tokens": MAX_TOKENS, "top_k": TOP_K, "seed": SEED}
_NUMBER_LIMITS = {"temperature": TEMPERATURE, "top_p": TOP_P}


def _check_override(key: str, name: str, value: Any) -> Any:
    """Validate one override; `name` is how the line spells it (e.g. "body.top_p")."""
    if key in _INT_LIMITS:
        return _check_int(name, value, _INT_LIMITS[key])
    if key in _NUMBER_LIMITS:
        return _check_number(name, value, _NUMBER_LIMITS[key])
    return _check_stop(name, value)  # "stop", the last of SAMPLING_KEYS


def _check_content(name: str, value: Any) -> str:
    """A message's content: a string, or an array of text parts joined with newlines (as vLLM joins them)."""
    if not isinstance(value, list):
        return _check_text(name, value)
    if not value:
        raise LineError(f'"{name}" must not be empty')
    texts = []
    for i, part in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(part, dict):
            raise LineError(f'"{where}" must be an object, got {_type_name(part)}')
        if part.get("type") != "text":
            raise LineError(f'"{where}.type" must be "text" (specq reads text only), got {_echo(part.get("type"))}')
        if not part.keys() <= CONTENT_PART_FIELDS:
            raise LineError(f'"{where}" has unsupported field {_first_key(part.keys() - CONTENT_PART_FIELDS)}')
        texts.append(_check_text(f"{where}.text", part.get("text")))
    return "\n".join(texts)


def _check_message(where: str, message: Any) -> dict[str, str]:
    if not isinstance(message, dict):
        raise LineError(f'"{where}" must be an object, got {_type_name(message)}')
    if not message.keys() <= _MESSAGE_KEYS:
        raise LineError(f'"{where}" has unsupported field {_first_key(message.keys() - _MESSAGE_KEYS)}')
    if "role" not in message:
        raise LineError(f'"{where}" is missing "role"')
    role = message["role"]
    if isinstance(role, str) and role in TOOL_ROLES:
        raise LineError(f'"{where}.role" {_echo(role)} is not supported: specq calls no tools')
    if not isinstance(role, str) or role not in CHAT_ROLES:  # an array or object is not hashable
        raise LineError(f'"{where}.role" must be one of {_ROLES_TEXT}, got {_echo(role)}')
    for key in MESSAGE_NEUTRAL_FIELDS & message.keys():
        if message[key] not in (None, []):
            raise LineError(f'"{where}.{key}" is not supported: specq calls no tools and reads text only')
    if "content" not in message:
        raise LineError(f'"{where}" is missing "content"')
    checked = {"role": CHAT_ROLES[role], "content": _check_content(f"{where}.content", message["content"])}
    if "name" in message:
        checked["name"] = _check_text(f"{where}.name", message["name"])
    return checked


def _check_messages(name: str, value: Any) -> list[dict]:
    if not isinstance(value, list):
        raise LineError(f'"{name}" must be an array, got {_type_name(value)}')
    if not value:
        raise LineError(f'"{name}" must not be empty')
    return [_check_message(f"{name}[{i}]", message) for i, message in enumerate(value)]


def _check_token_ids(name: str, value: list) -> tuple[int, ...]:
    for i, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool):
            raise LineError(f'"{name}[{i}]" must be a token id (an integer), got {_type_name(token)}')
        _check_range(f"{name}[{i}]", token, token, TOKEN_ID)
    return tuple(value)


def _check_prompt(name: str, value: Any) -> str | tuple[int, ...]:
    """A completion prompt: a string or token ids, alone or as the one item of an array (OpenAI's
    batched form). Several prompts are refused: OpenAI makes one choice per prompt, and a line of
    specq is one request, so each prompt goes on its own line."""
    if not isinstance(value, list):
        return _check_text(name, value)
    if not value:
        raise LineError(f'"{name}" must not be empty')
    if any(isinstance(item, int) and not isinstance(item, bool) for item in value):  # token ids, one checked each
        return _check_token_ids(name, value)
    if len(value) > 1:
        raise LineError(
            f'"{name}" holds {len(value)} prompts; specq takes one a line (OpenAI answers each prompt '
            "apart): give each prompt its own line"
        )
    (item,) = value
    if isinstance(item, list):
        if not item:
            raise LineError(f'"{name}[0]" must not be empty')
        return _check_token_ids(f"{name}[0]", item)
    return _check_text(f"{name}[0]", item)


@dataclass(frozen=True, slots=True)
class _Prompt:
    kind: RequestKind
    prompt: str | None = None
    messages: list[dict] | None = None
    token_ids: tuple[int, ...] | None = None


def _read_prompt(obj: dict, prefix: str) -> _Prompt:
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt and has_messages:
        raise LineError(f'has both "{prefix}prompt" and "{prefix}messages"; give one')
    if has_messages:
        return _Prompt("chat", messages=_check_messages(f"{prefix}messages", obj["messages"]))
    if not has_prompt:
        raise LineError(f'missing "{prefix}prompt"')
    prompt = _check_prompt(f"{prefix}prompt", obj["prompt"])
    if isinstance(prompt, str):
        return _Prompt("completion", prompt=prompt)
    return _Prompt("completion", token_ids=prompt)


def _read_overrides(obj: dict, prefix: str) -> dict:
    overrides = {}
    for key, value in obj.items():
        if key in _OVERRIDE_SET and value is not None:
            overrides[key] = _check_override(key, prefix + key, value)
    return overrides


def _spec(
    line: int, request_id: str, prompt: _Prompt, overrides: dict, model: str | None = None, n: int = 1
) -> RequestSpec:
    return RequestSpec(
        line, request_id, prompt.kind, prompt.prompt, prompt.messages, overrides, prompt.token_ids, model, n
    )


def _read_n(obj: dict, name: str) -> int:
    """The line's `n` (completions of it), 1 when absent or null."""
    return 1 if obj.get("n") is None else _check_int(name, obj["n"], CHOICES)


def _parse_plain(obj: dict, line: int) -> RequestSpec:
    if not obj.keys() <= _PLAIN_KEYS:
        raise LineError(f"unknown field {_first_key(obj.keys() - _PLAIN_KEYS)}")
    request_id = _check_id("id", obj["id"]) if "id" in obj else str(line)
    overrides = _read_overrides(obj, "")
    if obj.get("logprobs") is not None:
        overrides["logprobs"] = _check_int("logprobs", obj["logprobs"], LOGPROBS)
    return _spec(line, request_id, _read_prompt(obj, ""), overrides, n=_read_n(obj, "n"))


def _openai_logprobs(body: dict, url: str) -> int | None:
    """How many top alternatives an OpenAI line asks for each token, as specq's `logprobs`; None: none.
    /v1/completions: `logprobs: N` (0 to 5). Chat: `logprobs: true`, with `top_logprobs: N` (0 to 20)."""
    value = body.get("logprobs")
    if url == COMPLETIONS_URL:
        return None if value is None else _check_int("body.logprobs", value, COMPLETIONS_LOGPROBS)
    top = body.get("top_logprobs")
    if value is not None and not isinstance(value, bool):
        raise LineError(f'"body.logprobs" must be true or false, got {_type_name(value)}')
    if not value:
        if top is not None and top != 0:
            raise LineError('"body.top_logprobs" needs "body.logprobs": true')
        return None
    return 0 if top is None else _check_int("body.top_logprobs", top, LOGPROBS)


def _check_body_fields(body: dict, url: str) -> None:
    """Every field is one `url` defines; one specq cannot honour is at its neutral value (openai_fields)."""
    for key, value in body.items():
        field = BODY_FIELDS.get(key)
        if field is None or url not in field.endpoints:
            raise LineError(f"{_echo('body.' + key)} is not a field of {url}")
        if field.neutral is not None and not field.neutral(value, body):
            raise LineError(
                f"{_echo('body.' + key)} is not supported: specq accepts it only as {field.neutral_text}, "
                f"got {_echo(value)}"
            )


def _parse_openai(obj: dict, line: int) -> RequestSpec:
    if obj.keys() != _OPENAI_KEYS:
        if not obj.keys() <= _OPENAI_KEYS:
            raise LineError(f"unknown field {_first_key(obj.keys() - _OPENAI_KEYS)} in an OpenAI Batch line")
        for key in ("custom_id", "method", "url", "body"):
            if key not in obj:
                raise LineError(f'missing "{key}" (an OpenAI Batch line has custom_id, method, url, body)')
    request_id = _check_id("custom_id", obj["custom_id"])
    if obj["method"] != "POST":
        raise LineError(f'"method" must be "POST", got {_echo(obj["method"])}')
    url = obj["url"]
    if url not in (COMPLETIONS_URL, CHAT_URL):
        raise LineError(f'"url" must be "{COMPLETIONS_URL}" or "{CHAT_URL}", got {_echo(url)}')
    body = obj["body"]
    if not isinstance(body, dict):
        raise LineError(f'"body" must be an object, got {_type_name(body)}')
    expected = "messages" if url == CHAT_URL else "prompt"
    if expected not in body:
        raise LineError(f'missing "body.{expected}" (required by {url})')
    _check_body_fields(body, url)
    prompt = _read_prompt(body, "body.")
    overrides = _read_overrides(body, "body.")
    if body.get("max_completion_tokens") is not None:
        if "max_tokens" in overrides:
            raise LineError('has both "body.max_tokens" and "body.max_completion_tokens"; give one')
        overrides["max_tokens"] = _check_override(
            "max_tokens", "body.max_completion_tokens", body["max_completion_tokens"]
        )
    logprobs = _openai_logprobs(body, url)
    if logprobs is not None:
        overrides["logprobs"] = logprobs
    model = body.get("model")
    return _spec(
        line, request_id, prompt, overrides, model if isinstance(model, str) else None, _read_n(body, "body.n")
    )


MAX_JSON_DEPTH = 1024  # orjson's limit: arrays and objects nested deeper are refused
_decode_json = json.JSONDecoder().decode  # json.loads minus its per-call argument handling


def _loads(text: str) -> Any:
    """orjson (several times faster; parsing is most of what submit costs), and the standard parser
    where orjson refuses: its message for broken JSON, and what it accepts that orjson does not (NaN,
    lone surrogates, integers past 64 bits), which validation then reports in its own words."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):  # the standard parser would recurse until Python's own limit
            raise LineError(f"not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
        return _decode_json(text)


def parse_line(raw: bytes, line: int) -> RequestSpec:
    """Parse one non-blank line (bytes, as read from the file); raises LineError saying what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LineError(f"not valid UTF-8 (byte {exc.start + 1})") from None
    if line == 1 and text.startswith("\ufeff"):
        text = text[1:]  # a UTF-8 byte order mark, as some editors write
    try:
        obj = _loads(text)
    except RecursionError:  # nesting that orjson refused for another reason, deep enough for the fallback
        raise LineError(f"not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except LineError:
        raise
    except ValueError as exc:
        if "integer string conversion" in str(exc):  # Python's own limit, against quadratic-time parsing
            raise LineError(f"not valid JSON: an integer longer than {sys.get_int_max_str_digits()} digits") from None
        msg = getattr(exc, "msg", str(exc))
        col = getattr(exc, "colno", None)
        raise LineError(f"not valid JSON: {msg}" + (f" (column {col})" if col else "")) from None
    if not isinstance(obj, dict):
        raise LineError(f"must be a JSON object, got {_type_name(obj)}")
    if "custom_id" in obj or "body" in obj or "url" in obj or "method" in obj:
        return _parse_openai(obj, line)
    return _parse_plain(obj, line)


def _lines(f: Any, max_line: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, raw line) of a binary file; None for a line longer than `max_line` bytes (not
    counting its newline), whose rest is skipped without being kept."""
    readline = f.readline
    number = 0
    while raw := readline(max_line + 1):
        number += 1
        if len(raw) <= max_line or raw.endswith(b"\n"):  # at most max_line bytes, then a newline
            yield number, raw
            continue
        while (rest := readline(1 << 20)) and not rest.endswith(b"\n"):
            pass
        yield number, None


# what this job makes of a good line: the spec to store (chat lines rendered to token ids, jobs.chat_template),
# or what is wrong with it in this job
Preparation = Callable[[RequestSpec], "RequestSpec | str"]


class _Scan:
    """One streaming read of the file: yields good specs, collects problems and id hashes."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        limits: InputLimits | None = None,
        name: str | None = None,
        prepare: Preparation | None = None,
    ) -> None:
        self.path = path
        self.name = os.fspath(path) if name is None else name
        self.limits = limits or InputLimits.from_env()
        self.prepare = prepare
        self.problems: list[tuple[int, str]] = []
        self.id_hashes = array("q")  # hash(id) of each good line: 8 bytes a line, whatever its size

    def _too_long(self) -> str:
        return (
            f"the line is longer than {self.limits.max_line_bytes} bytes "
            f"(the limit; raise it with --max-line-bytes or {MAX_LINE_ENV})"
        )

    def __iter__(self) -> Iterator[RequestSpec]:
        problems, hashes = self.problems, self.id_hashes
        size = os.path.getsize(self.path)
        if size > self.limits.max_file_bytes:
            raise BadInputError(
                [
                    f"{self.name}: the file is {size} bytes, over the limit of {self.limits.max_file_bytes} "
                    f"(raise it with --max-input-bytes or {MAX_INPUT_ENV})"
                ]
            )
        with open(self.path, "rb") as f:
            for number, raw in _lines(f, self.limits.max_line_bytes):
                if raw is None:
                    problems.append((number, self._too_long()))
                    continue
                if raw.isspace():
                    continue
                try:
                    spec = parse_line(raw, number)
                except LineError as exc:
                    problems.append((number, str(exc)))
                    continue
                hashes.append(hash(spec.id))
                if self.prepare is not None:
                    prepared = self.prepare(spec)
                    if isinstance(prepared, str):
                        problems.append((number, prepared))
                        continue
                    spec = prepared
                yield spec

    def finish(self) -> None:
        """Add duplicate-id problems, then raise BadInputError if any line was bad."""
        self.problems.extend(self._duplicates())
        if self.problems:
            self.problems.sort()
            raise BadInputError([f"{self.name}:{line}: {what}" for line, what in self.problems])

    def _duplicates(self) -> list[tuple[int, str]]:
        hashes = np.frombuffer(self.id_hashes, dtype=np.int64) if self.id_hashes else np.empty(0, np.int64)
        ordered = np.sort(hashes)
        repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
        if not repeated:
            return []
        # Hashes can collide, so read the file again and compare the ids whose hash repeats (a rare, and
        # then failing, path: only the first read has to be fast)
        first_line: dict[str, int] = {}
        found = []
        with open(self.path, "rb") as f:
            for number, raw in _lines(f, self.limits.max_line_bytes):
                if raw is None or raw.isspace():
                    continue
                try:
                    request_id = parse_line(raw, number).id
                except LineError:
                    continue
                if hash(request_id) not in repeated:
                    continue
                first = first_line.setdefault(request_id, number)
                if first != number:
                    found.append((number, f"duplicate id {_echo(request_id)} (first on line {first})"))
        return found


def iter_request_specs(
    path: str | os.PathLike[str],
    limits: InputLimits | None = None,
    *,
    name: str | None = None,
    prepare: Preparation | None = None,
) -> Iterator[RequestSpec]:
    """Stream the good requests of `path`; at the end raise BadInputError listing every bad line.

    Good lines are yielded before the file is known to be good; call `validate_file` first when nothing
    may happen unless the whole file is good. `limits`: None reads them from the environment. `name`:
    the input as messages name it (default: `path`). `prepare`: what this job makes of a good line
    (a chat line rendered to token ids), or what it cannot run of it, reported like a bad line.
    """
    scan = _Scan(path, limits, name, prepare)
    yield from scan
    scan.finish()


def validate_file(
    path: str | os.PathLike[str],
    limits: InputLimits | None = None,
    *,
    name: str | None = None,
    prepare: Preparation | None = None,
) -> int:
    """Read the whole file once and return its number of requests (a line with `n` > 1 is n requests, its
    choices); raise BadInputError if any line is bad (`name` and `prepare` as for `iter_request_specs`)."""
    scan = _Scan(path, limits, name, prepare)
    count = sum(spec.n for spec in scan)
    scan.finish()
    return count
