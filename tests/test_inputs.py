"""Input parsing: both line forms, every error path, the exact `INPUT:LINE: reason` messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specq.errors import BadInputError
from specq.jobs.inputs import RequestSpec, iter_request_specs, validate_file


def write_lines(path: Path, lines: list[object]) -> str:
    """Write `lines` (dicts/lists are JSON-encoded, str and bytes are written as they are)."""
    with open(path, "wb") as f:
        for line in lines:
            if isinstance(line, bytes):
                f.write(line + b"\n")
            elif isinstance(line, str):
                f.write(line.encode("utf-8") + b"\n")
            else:
                f.write(json.dumps(line).encode("utf-8") + b"\n")
    return str(path)


def problems_of(path: str) -> list[str]:
    with pytest.raises(BadInputError) as info:
        validate_file(path)
    # iter_request_specs reports exactly the same problems
    with pytest.raises(BadInputError) as info2:
        list(iter_request_specs(path))
    assert info2.value.problems == info.value.problems
    return info.value.problems


def one_problem(tmp_path: Path, line: object) -> str:
    path = write_lines(tmp_path / "in.jsonl", [line])
    problems = problems_of(path)
    assert len(problems) == 1, problems
    prefix = f"{path}:1: "
    assert problems[0].startswith(prefix), problems[0]
    return problems[0][len(prefix) :]


def openai(url: str = "/v1/completions", **body: object) -> dict:
    return {"custom_id": "c1", "method": "POST", "url": url, "body": body}


def test_plain_lines_with_defaults_and_overrides(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            {"prompt": "hello"},
            {"id": "q2", "prompt": "x", "max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 3},
            {"id": 7, "prompt": "y", "seed": 2**63 - 1, "stop": "\n"},
            {"id": "c", "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b"]},
        ],
    )
    assert validate_file(path) == 4
    specs = list(iter_request_specs(path))
    assert specs[0] == RequestSpec(1, "1", "completion", "hello", None, {})
    assert specs[1].overrides == {"max_tokens": 5, "temperature": 0.0, "top_p": 0.5, "top_k": 3}
    assert isinstance(specs[1].overrides["temperature"], float)
    assert specs[2].id == "7"
    assert specs[2].overrides == {"seed": 2**63 - 1, "stop": ("\n",)}
    assert specs[3].kind == "chat"
    assert specs[3].messages == [{"role": "user", "content": "hi"}]
    assert specs[3].overrides == {"stop": ("a", "b")}


def test_openai_lines_both_urls(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            {
                "custom_id": "a",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "m-1", "prompt": "p", "max_tokens": 8, "temperature": 0.7},
            },
            {
                "custom_id": "b",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "x",
                    "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                    "max_completion_tokens": 9,
                    "stop": None,
                    "n": 1,
                    "stream": False,
                },
            },
        ],
    )
    a, b = iter_request_specs(path)
    assert a == RequestSpec(1, "a", "completion", "p", None, {"max_tokens": 8, "temperature": 0.7}, model="m-1")
    assert b.model == "x"  # kept to echo in OpenAI-format output; the job's target runs every line
    assert b.kind == "chat" and b.prompt is None
    assert b.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert b.overrides == {"max_tokens": 9}


def test_blank_lines_skipped_but_counted(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", [{"prompt": "a"}, "", "   \t", {"prompt": "b"}, "nope"])
    problems = problems_of(path)
    assert problems == [f"{path}:5: not valid JSON: Expecting value (column 1)"]
    specs: list[RequestSpec] = []
    with pytest.raises(BadInputError):
        specs.extend(iter_request_specs(path))
    assert [(s.line, s.id) for s in specs] == [(1, "1"), (4, "4")]


def test_utf8_bom_and_unicode(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "h\u00e9llo \u2603"}, ensure_ascii=False).encode())
    (spec,) = iter_request_specs(path)
    assert spec.prompt == "h\u00e9llo \u2603"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON: Expecting property name enclosed in double quotes (column 2)"),
        ('{"prompt": "a"} x', "not valid JSON: Extra data (column 17)"),
        (b'{"prompt": "\xff"}', "not valid UTF-8 (byte 13)"),
        ("[1, 2]", "must be a JSON object, got array"),
        ('"text"', "must be a JSON object, got string"),
        ({}, 'missing "prompt"'),
        ({"id": "a"}, 'missing "prompt"'),
        ({"prompt": 3}, '"prompt" must be a string, got number'),
        ({"prompt": None}, '"prompt" must be a string, got null'),
        ({"prompt": [1.5]}, '"prompt[0]" must be a string, got number'),
        ({"prompt": []}, '"prompt" must not be empty'),
        ({"prompt": [[]]}, '"prompt[0]" must not be empty'),
        ({"prompt": [1, -1]}, '"prompt[1]" must be in [0, 2147483647], got -1'),
        ({"prompt": [1, "a"]}, '"prompt[1]" must be a token id (an integer), got string'),
        ({"prompt": [[1, 2**31]]}, '"prompt[0][1]" must be in [0, 2147483647], got 2147483648'),
        ({"prompt": [[1, True]]}, '"prompt[0][1]" must be a token id (an integer), got boolean'),
        (
            {"prompt": ["a", "b"]},
            '"prompt" holds 2 prompts; specq takes one a line (OpenAI answers each prompt apart): '
            "give each prompt its own line",
        ),
        ({"prompt": ""}, '"prompt" must not be empty'),
        ({"prompt": "a\u0000b"}, '"prompt" contains a NUL character, which cannot be stored'),
        ('{"prompt": "\\ud800"}', '"prompt" contains a lone surrogate (invalid Unicode)'),
        ({"prompt": "a", "messages": []}, 'has both "prompt" and "messages"; give one'),
        ({"prompt": "a", "max_token": 3}, 'unknown field "max_token"'),
        ({"id": True, "prompt": "a"}, '"id" must be a string or an integer, got boolean'),
        ({"id": 1.5, "prompt": "a"}, '"id" must be a string or an integer, got number'),
        ({"id": "", "prompt": "a"}, '"id" must not be empty'),
        ({"id": None, "prompt": "a"}, '"id" must be a string or an integer, got null'),
        ({"prompt": "a", "max_tokens": 0}, '"max_tokens" must be in [1, 1000000], got 0'),
        ({"prompt": "a", "max_tokens": 1_000_001}, '"max_tokens" must be in [1, 1000000], got 1000001'),
        ({"prompt": "a", "max_tokens": 5.0}, '"max_tokens" must be an integer, got number'),
        ({"prompt": "a", "max_tokens": "5"}, '"max_tokens" must be an integer, got string'),
        ({"prompt": "a", "max_tokens": True}, '"max_tokens" must be an integer, got boolean'),
        ({"prompt": "a", "temperature": -0.1}, '"temperature" must be in [0, 2], got -0.1'),
        ({"prompt": "a", "temperature": 2.5}, '"temperature" must be in [0, 2], got 2.5'),
        ({"prompt": "a", "temperature": False}, '"temperature" must be a number, got boolean'),
        ({"prompt": "a", "temperature": "0"}, '"temperature" must be a number, got string'),
        ('{"prompt": "a", "temperature": NaN}', '"temperature" must be a finite number, got nan'),
        ({"prompt": "a", "top_p": 0}, '"top_p" must be in (0, 1], got 0'),
        ({"prompt": "a", "top_p": 1.01}, '"top_p" must be in (0, 1], got 1.01'),
        ({"prompt": "a", "top_k": -1}, '"top_k" must be in [0, 2147483647], got -1'),
        ({"prompt": "a", "top_k": 2.0}, '"top_k" must be an integer, got number'),
        ({"prompt": "a", "seed": -1}, '"seed" must be in [0, 9223372036854775807], got -1'),
        (
            {"prompt": "a", "seed": 2**63},
            '"seed" must be in [0, 9223372036854775807], got 9223372036854775808',
        ),
        ({"prompt": "a", "seed": "1"}, '"seed" must be an integer, got string'),
        ({"prompt": "a", "stop": ""}, '"stop" must not be empty'),
        ({"prompt": "a", "stop": []}, '"stop" must hold 1 to 4 strings, got 0'),
        ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, '"stop" must hold 1 to 4 strings, got 5'),
        ({"prompt": "a", "stop": ["a", 1]}, '"stop[1]" must be a string, got number'),
        ({"prompt": "a", "stop": ["a", ""]}, '"stop[1]" must not be empty'),
        ({"prompt": "a", "stop": 5}, '"stop" must be a string or an array of strings, got number'),
        ({"messages": "hi"}, '"messages" must be an array, got string'),
        ({"messages": []}, '"messages" must not be empty'),
        ({"messages": ["hi"]}, '"messages[0]" must be an object, got string'),
        ({"messages": [{"content": "x"}]}, '"messages[0]" is missing "role"'),
        ({"messages": [{"role": "user"}]}, '"messages[0]" is missing "content"'),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            '"messages[0].role" must be one of "system", "developer", "user", "assistant", got "robot"',
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            '"messages[0].content[0].text" must be a string, got null',
        ),
        ({"messages": [{"role": "user", "content": []}]}, '"messages[0].content" must not be empty'),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            '"messages[0].content[0].type" must be "text" (specq reads text only), got "image_url"',
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}]},
            '"messages[0].content[0]" has unsupported field "extra"',
        ),
        (
            {"messages": [{"role": "user", "content": "x", "name": 3}]},
            '"messages[0].name" must be a string, got number',
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "t"}]},
            '"messages[0]" has unsupported field "tool_call_id"',
        ),
        (
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": "t"}]},
            '"messages[0]" has unsupported field "tool_call_id"',
        ),
        (
            {"messages": [{"role": "tool", "content": "x"}]},
            '"messages[0].role" "tool" is not supported: specq calls no tools',
        ),
        (
            {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
            '"messages[0].tool_calls" is not supported: specq calls no tools and reads text only',
        ),
    ],
)
def test_plain_line_errors(tmp_path: Path, line: object, message: str) -> None:
    assert one_problem(tmp_path, line) == message


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "p"}},
            'missing "method" (an OpenAI Batch line has custom_id, method, url, body)',
        ),
        (
            {"method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}},
            'missing "custom_id" (an OpenAI Batch line has custom_id, method, url, body)',
        ),
        (
            {"custom_id": "c", "method": "POST", "url": "/v1/completions"},
            'missing "body" (an OpenAI Batch line has custom_id, method, url, body)',
        ),
        (
            {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {}, "extra": 1},
            'unknown field "extra" in an OpenAI Batch line',
        ),
        (
            {"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {"prompt": "p"}},
            '"method" must be "POST", got "GET"',
        ),
        (
            {"custom_id": "c", "method": "POST", "url": "/v1/embeddings", "body": {"input": "p"}},
            '"url" must be "/v1/completions" or "/v1/chat/completions", got "/v1/embeddings"',
        ),
        (
            {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": "p"},
            '"body" must be an object, got string',
        ),
        (
            {"custom_id": ["c"], "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}},
            '"custom_id" must be a string or an integer, got array',
        ),
        (openai(), 'missing "body.prompt" (required by /v1/completions)'),
        (
            openai("/v1/chat/completions", prompt="p"),
            'missing "body.messages" (required by /v1/chat/completions)',
        ),
        (
            openai("/v1/completions", messages=[{"role": "user", "content": "x"}]),
            'missing "body.prompt" (required by /v1/completions)',
        ),
        (
            openai("/v1/chat/completions", messages=[{"role": "user", "content": "x"}], prompt="p"),
            '"body.prompt" is not a field of /v1/chat/completions',
        ),
        (
            openai(prompt=["a", "b"]),
            '"body.prompt" holds 2 prompts; specq takes one a line (OpenAI answers each prompt apart): '
            "give each prompt its own line",
        ),
        (openai(prompt="p", max_completion_tokens=4), '"body.max_completion_tokens" is not a field of /v1/completions'),
        (openai(prompt="p", top_k_typo=4), '"body.top_k_typo" is not a field of /v1/completions'),
        (openai(prompt="p", max_tokens=0), '"body.max_tokens" must be in [1, 1000000], got 0'),
        (openai(prompt="p", temperature=3), '"body.temperature" must be in [0, 2], got 3'),
        (
            openai("/v1/chat/completions", messages=[{"role": "user", "content": "x"}], max_completion_tokens=-2),
            '"body.max_completion_tokens" must be in [1, 1000000], got -2',
        ),
        (
            openai(
                "/v1/chat/completions",
                messages=[{"role": "user", "content": "x"}],
                max_tokens=3,
                max_completion_tokens=4,
            ),
            'has both "body.max_tokens" and "body.max_completion_tokens"; give one',
        ),
        (
            openai("/v1/chat/completions", messages=[{"role": "user"}]),
            '"body.messages[0]" is missing "content"',
        ),
    ],
)
def test_openai_line_errors(tmp_path: Path, line: object, message: str) -> None:
    assert one_problem(tmp_path, line) == message


def test_every_bad_line_reported_in_order_with_duplicates(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "a", "prompt": "x"},  # 1
            {"id": "b", "prompt": 1},  # 2 bad type
            {"prompt": "3 has id '3'"},  # 3 -> id "3"
            {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}},  # 4 dup
            {"id": 3, "prompt": "int id 3 equals line 3's id"},  # 5 dup of line 3
            "oops",  # 6
            {"id": "a", "prompt": "again"},  # 7 dup of line 1
            {"id": "b", "prompt": "fine: line 2 was bad, so b is new"},  # 8
        ],
    )
    assert problems_of(path) == [
        f'{path}:2: "prompt" must be a string, got number',
        f'{path}:4: duplicate id "a" (first on line 1)',
        f'{path}:5: duplicate id "3" (first on line 3)',
        f"{path}:6: not valid JSON: Expecting value (column 1)",
        f'{path}:7: duplicate id "a" (first on line 1)',
    ]


def test_error_names_input_as_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_lines(tmp_path / "rel.jsonl", ["x"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInputError) as info:
        validate_file("rel.jsonl")
    assert info.value.problems == ["rel.jsonl:1: not valid JSON: Expecting value (column 1)"]
    assert str(info.value) == "rel.jsonl:1: not valid JSON: Expecting value (column 1)"


def test_empty_file_has_no_requests(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", ["", " "])
    assert validate_file(path) == 0
    assert list(iter_request_specs(path)) == []


def test_many_lines_stream(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    with open(path, "w") as f:
        for i in range(20_000):
            f.write(json.dumps({"id": f"q{i}", "prompt": "p" * (i % 50 + 1), "max_tokens": 4}) + "\n")
    assert validate_file(path) == 20_000
    ids = [spec.id for spec in iter_request_specs(path)]
    assert ids[0] == "q0" and ids[-1] == "q19999" and len(set(ids)) == 20_000


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[" * 100_000 + "]" * 100_000, "not valid JSON: nested deeper than 1024 levels"),
        ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "not valid JSON: nested deeper than 1024 levels"),
        (
            '{"prompt": "a", "x": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}",
            "not valid JSON: nested deeper than 1024 levels",
        ),
        (
            {"messages": [{"role": ["user"], "content": "x"}]},
            '"messages[0].role" must be one of "system", "developer", "user", "assistant", got array',
        ),
        (
            {"messages": [{"role": {"a": 1}, "content": "x"}]},
            '"messages[0].role" must be one of "system", "developer", "user", "assistant", got object',
        ),
        (
            {"messages": [{"role": 3, "content": "x"}]},
            '"messages[0].role" must be one of "system", "developer", "user", "assistant", got 3',
        ),
        (
            openai("/v1/chat/completions", messages=[{"role": [], "content": "x"}]),
            '"body.messages[0].role" must be one of "system", "developer", "user", "assistant", got array',
        ),
        ({"prompt": "a", "top_k": 2**63}, '"top_k" must be in [0, 2147483647], got 9223372036854775808'),
        ({"prompt": "a", "top_k": 2**31}, '"top_k" must be in [0, 2147483647], got 2147483648'),
        # integers past a float's range are compared, never converted (that raised OverflowError)
        ({"prompt": "a", "temperature": 10**400}, f'"temperature" must be in [0, 2], got {str(10**400)[:77]}...'),
        ({"prompt": "a", "top_p": -(10**400)}, f'"top_p" must be in (0, 1], got {str(-(10**400))[:77]}...'),
        ('{"prompt": "a", "seed": 1' + "0" * 5000 + "}", "not valid JSON: an integer longer than 4300 digits"),
    ],
)
def test_hostile_lines_are_line_errors(tmp_path: Path, line: object, message: str) -> None:
    assert one_problem(tmp_path, line) == message


def test_top_k_at_its_bound_is_accepted(tmp_path: Path) -> None:
    (spec,) = iter_request_specs(write_lines(tmp_path / "in.jsonl", [{"prompt": "a", "top_k": 2**31 - 1}]))
    assert spec.overrides == {"top_k": 2**31 - 1}


def test_echoed_keys_and_values_cannot_forge_report_lines(tmp_path: Path) -> None:
    """Whatever a line holds, its report is one line: keys and values it echoes are JSON-quoted."""
    forged = 'x"\nIN.jsonl:99: "prompt" must not be empty\n'
    lines: list[object] = [
        {"prompt": "a", forged: 1},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}, forged: 1},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p", forged: 1}},
        {"messages": [{"role": "user", "content": "x", forged: 1}]},
        {"messages": [{"role": forged, "content": "x"}]},
        {"custom_id": "c", "method": forged, "url": "/v1/completions", "body": {"prompt": "p"}},
        {"custom_id": "c", "method": "POST", "url": forged, "body": {"prompt": "p"}},
        openai(prompt="p", n=forged),
        {"id": forged, "prompt": "a"},
        {"id": forged, "prompt": "a"},
        {"prompt": "a", "x" * 1000: 1},
    ]
    path = write_lines(tmp_path / "in.jsonl", lines)
    problems = problems_of(path)
    assert len(problems) == len(lines) - 1  # the first of the two same ids is good
    for problem in problems:
        assert "\n" not in problem and "\r" not in problem, problem
        assert len(problem) < len(path) + 200, problem
    quoted = json.dumps(forged)
    assert problems[0] == f"{path}:1: unknown field {quoted}"
    assert problems[1] == f"{path}:2: unknown field {quoted} in an OpenAI Batch line"
    assert problems[2] == f"{path}:3: {json.dumps('body.' + forged)} is not a field of /v1/completions"
    assert problems[3] == f'{path}:4: "messages[0]" has unsupported field {quoted}'
    assert problems[4].endswith(f"got {quoted}")
    assert problems[8] == f"{path}:10: duplicate id {quoted} (first on line 9)"
    assert problems[9] == f'{path}:11: unknown field "{"x" * 76}...'
