"""Where the input comes from and what chat lines render with, through the commands on the real services:

- standard input (`-`), `/dev/stdin` on a pipe and a FIFO are read once (spooled), every check intact:
  duplicate ids stop `submit` with nothing stored, `run` writes every line (issue 10);
- chat lines on a target without a chat template are refused at submit and before `run`, every one
  named; `--chat-template FILE` renders them, and is stored with the job for the workers (issue 9);
- prompts given as token ids decode as the text they encode.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from sqlalchemy import select

from specq.db.models import Job, Request
from specq.db.session import open_database
from tests.services import count_rows, invoke, services_env, write_requests

LINES = [
    {"id": "a", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0},
    {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["class A:"], "max_tokens": 3}},
]
DUPLICATE = [*LINES, {"id": "a", "prompt": "again"}]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}{% if m.name %}({{ m.name }}){% endif %}: {{ m['content'] }}\n{% endfor %}"
)


def specq_process(args: list[str], env: dict[str, str], stdin: bytes) -> subprocess.CompletedProcess[bytes]:
    """`specq ARGS` as a process of its own, fed `stdin` through a pipe."""
    return subprocess.run(
        [sys.executable, "-P", "-m", "specq", *args], env=env, input=stdin, capture_output=True, timeout=180
    )


def jsonl(lines: list[object]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def ids_of(text: str) -> list[str]:
    return [json.loads(line)["id"] for line in text.splitlines()]


@pytest.fixture
def env(pg_db_url, tmp_path):
    return services_env(pg_db_url, None, tmp_path / "home")


def test_stdin_dash_and_pipes_are_read_once_with_every_check(env, pg_db_url, tiny_pair, tmp_path) -> None:
    target = ["--target", tiny_pair[0]]
    # `run -`: stdout by default
    result = invoke(["run", "-", *target], env, stdin=jsonl(LINES))
    assert result.exit_code == 0, result.output
    assert ids_of(result.stdout) == ["a", "b"]

    # `submit -` with a repeated id: refused whole, nothing stored
    result = invoke(["submit", "-", *target], env, stdin=jsonl(DUPLICATE))
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[0] == '<stdin>:3: duplicate id "a" (first on line 1)'
    assert count_rows(pg_db_url, Request) == 0

    # `/dev/stdin` on a pipe, in a process of its own: it wrote nothing with exit 0, and stored duplicates
    out = tmp_path / "out.jsonl"
    ran = specq_process(["run", "/dev/stdin", "-o", str(out), *target], env, jsonl(LINES))
    assert ran.returncode == 0, ran.stderr
    assert ids_of(out.read_text()) == ["a", "b"]
    submitted = specq_process(["submit", "/dev/stdin", *target], env, jsonl(DUPLICATE))
    assert submitted.returncode == 2, submitted.stderr
    assert b'/dev/stdin:3: duplicate id "a" (first on line 1)' in submitted.stderr
    assert count_rows(pg_db_url, Request) == 0

    # a FIFO, written by another process
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", 'cat "$0" > "$1"', write_requests(tmp_path / "in.jsonl", LINES), str(fifo)])
    result = invoke(["submit", str(fifo), *target, "--wait"], env)
    writer.wait(timeout=30)
    assert result.exit_code == 0, result.output
    with open_database(pg_db_url).session() as session:
        job = session.scalars(select(Job)).one()
        assert (job.input_name, job.total, job.state) == (str(fifo), 2, "completed")


@pytest.fixture
def templateless_target(tiny_pair, tmp_path) -> str:
    """A copy of the tiny target whose tokenizer has no chat template."""
    target = shutil.copytree(tiny_pair[0], tmp_path / "templateless")
    (target / "chat_template.jinja").unlink()
    return str(target)


def test_chat_lines_need_a_chat_template(env, pg_db_url, templateless_target, tmp_path) -> None:
    chat = {
        "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi", "name": "ann"}]
    }
    lines = [
        {"id": "c1", **chat, "max_tokens": 3, "temperature": 0},
        {"id": "p", "prompt": "def add(a, b):", "max_tokens": 3, "temperature": 0},
        {
            "custom_id": "c2",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**chat, "max_tokens": 3, "temperature": 0},
        },
        {"id": "bad", "prompt": ""},
    ]
    path = write_requests(tmp_path / "in.jsonl", lines)
    refusal = (
        f"chat messages need a chat template, and the tokenizer of {templateless_target!r} has none: "
        "give one with --chat-template FILE, or send a plain prompt"
    )
    expected = [
        f"{path}:1: {refusal}",
        f"{path}:3: {refusal}",
        f'{path}:4: "prompt" must not be empty',
        "Error: 3 bad lines; nothing was done",
    ]
    out = tmp_path / "out.jsonl"
    for command in (["run", path, "-o", str(out)], ["submit", path]):
        result = invoke([*command, "--target", templateless_target], env)
        assert result.exit_code == 2, result.output
        assert result.stderr.splitlines() == expected
    assert not out.exists() and count_rows(pg_db_url, Job) == 0

    # --chat-template renders them, in `run` and at submit alike (the job stores their token ids, not the
    # template: no worker renders)
    lines.pop()
    path = write_requests(tmp_path / "good.jsonl", lines)
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    with_template = ["--target", templateless_target, "--chat-template", str(template)]
    result = invoke(["run", path, "-o", str(out), *with_template], env)
    assert result.exit_code == 0, result.output
    ran = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    result = invoke(["submit", path, *with_template, "--wait"], env)
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip()
    with open_database(pg_db_url).session() as session:
        job = session.get(Job, job_id)
        assert job is not None and "chat_template" not in job.settings
        chats = session.scalars(select(Request).where(Request.job_id == job_id, Request.kind == "chat")).all()
        assert len(chats) == 2 and all(r.prompt_token_ids for r in chats)
    exported = tmp_path / "export.jsonl"
    assert invoke(["export", job_id, "-o", str(exported), "--format", "jsonl"], env).exit_code == 0
    stored = {r["id"]: r for r in map(json.loads, exported.read_text().splitlines())}

    from transformers import AutoTokenizer

    rendered = "system: Be brief.\nuser(ann): hi\n"  # developer as system, the name through to the template
    prompt_tokens = len(AutoTokenizer.from_pretrained(templateless_target)(rendered)["input_ids"])
    for request_id in ("c1", "c2"):
        assert ran[request_id]["prompt_tokens"] == stored[request_id]["prompt_tokens"] == prompt_tokens
        assert ran[request_id]["completion"] == stored[request_id]["completion"]

    template.write_text("{% for m in messages %}{{ m.content }")
    result = invoke(["run", path, "-o", str(out), *with_template], env)
    assert result.exit_code == 2
    assert f"--chat-template {template}: line 1:" in result.output and "Traceback" not in result.output


def test_prompt_token_ids_decode_as_their_text(env, pg_db_url, tiny_pair, tmp_path) -> None:
    from transformers import AutoTokenizer

    text = "def add(a, b):"
    ids = AutoTokenizer.from_pretrained(tiny_pair[0])(text)["input_ids"]
    completion = {"method": "POST", "url": "/v1/completions"}
    lines = [
        {"id": "text", "prompt": text, "max_tokens": 6, "temperature": 0},
        {"custom_id": "ids", **completion, "body": {"prompt": ids, "max_tokens": 6, "temperature": 0}},
        {"custom_id": "nested", **completion, "body": {"prompt": [ids], "max_tokens": 6, "temperature": 0}},
        {"custom_id": "outside", **completion, "body": {"prompt": [*ids, 10**6], "max_tokens": 6}},
    ]
    path = write_requests(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = invoke(["run", path, "-o", str(out), "--target", tiny_pair[0]], env)
    assert result.exit_code == 1, result.output  # the id outside the vocabulary fails alone
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["ids"]["tokens"] == records["nested"]["tokens"] == records["text"]["tokens"]
    assert "prompt token id 1000000 is outside the tokenizer's vocabulary" in records["outside"]["error"]

    result = invoke(["submit", path, "--target", tiny_pair[0], "--wait"], env)
    job_id = result.stdout.strip()
    exported = tmp_path / "export.csv"
    assert invoke(["export", job_id, "-o", str(exported)], env).exit_code == 0
    with open_database(pg_db_url).session() as session:
        stored = session.scalars(select(Request.prompt_token_ids).where(Request.custom_id == "ids")).one()
    assert stored == ids
    assert json.dumps(ids) in exported.read_text()
