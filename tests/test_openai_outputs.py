"""What OpenAI Batch parsers expect of specq's output, against the real services: the line's `model`
echoed (or `--served-model-name`), `created` from the result, ids stable across exports, OpenAI's error
codes, the output and error files apart, and the usage totals and rates of `specq status`."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from tests.services import invoke, job_status, services_env, submit_job, write_requests

MODEL = "gpt-4o-mini-2024-07-18"
LINES = [
    {
        "custom_id": "chat-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0},
    },
    {
        "custom_id": "cmpl-1",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "davinci-002", "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0},
    },
    {"id": "plain", "prompt": "class A:", "max_tokens": 4, "temperature": 0},
    {
        "custom_id": "too-long",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "davinci-002", "prompt": "x", "max_tokens": 999},
    },
]


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def export(env, job_id, path, *args) -> list[dict]:
    result = invoke(["export", job_id, "-o", str(path), *args], env)
    assert result.exit_code == 0, result.output
    return read_lines(path)


@pytest.fixture
def env(pg_db_url, tmp_path):
    return services_env(pg_db_url, None, tmp_path / "home")


@pytest.fixture
def finished_job(env, tiny_pair, tmp_path) -> str:
    """A job run to its end in-process (no broker): three completed requests, one past the context."""
    result = invoke(["submit", write_requests(tmp_path / "in.jsonl", LINES), "--target", tiny_pair[0], "--wait"], env)
    assert result.exit_code == 1, result.output  # the one past the context failed
    return result.stdout.strip()


def test_the_openai_export_echoes_models_keeps_ids_and_validates(env, finished_job, tiny_pair, pg_db_url, tmp_path):
    first = export(env, finished_job, tmp_path / "a.jsonl", "--format", "openai")
    again = export(env, finished_job, tmp_path / "b.jsonl", "--format", "openai")
    assert first == again  # ids and times come from the store, not from the export

    by_id = {line["custom_id"]: line for line in first}
    assert list(by_id) == ["chat-1", "cmpl-1", "plain", "too-long"]
    assert len({line["id"] for line in first}) == 4 and all(line["id"].startswith("batch_req_") for line in first)
    chat = ChatCompletion.model_validate(by_id["chat-1"]["response"]["body"])
    assert chat.model == MODEL and chat.id.startswith("chatcmpl-") and chat.object == "chat.completion"
    completion = Completion.model_validate(by_id["cmpl-1"]["response"]["body"])
    assert completion.model == "davinci-002" and completion.usage is not None
    # a plain line names no model: the target's name, never the folder's path
    plain = Completion.model_validate(by_id["plain"]["response"]["body"])
    assert plain.model == os.path.basename(tiny_pair[0]) and os.sep not in plain.model

    # `created` is when each result was stored
    from sqlalchemy import select

    from specq.db.models import Request, Result
    from specq.db.session import open_database

    with open_database(pg_db_url).session() as session:
        stored = dict(
            session.execute(
                select(Request.custom_id, Result.created_at)
                .join(Result, Result.request_id == Request.id)
                .where(Request.job_id == finished_job)
            ).all()
        )
    for custom_id in ("chat-1", "cmpl-1", "plain"):
        assert by_id[custom_id]["response"]["body"]["created"] == int(stored[custom_id].timestamp())
        assert by_id[custom_id]["response"]["status_code"] == 200 and by_id[custom_id]["error"] is None

    # a prompt past the context: a 400 with OpenAI's error body, not a job-level failure
    overflow = by_id["too-long"]
    assert overflow["error"] is None and overflow["response"]["status_code"] == 400
    error = overflow["response"]["body"]["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "prompt",
        "context_length_exceeded",
    )
    assert "exceeds the model's context" in error["message"]


def test_served_model_name_is_the_model_of_every_line(env, tiny_pair, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES[:3])
    job_id = submit_job(env, path, "--target", tiny_pair[0], "--served-model-name", "acme/coder-7b", "--wait")
    lines = export(env, job_id, tmp_path / "out.jsonl", "--format", "openai")
    assert [line["response"]["body"]["model"] for line in lines] == ["acme/coder-7b"] * 3

    out = tmp_path / "run.jsonl"  # `specq run` writes the same lines with --format openai
    args = ["run", path, "-o", str(out), "--target", tiny_pair[0], "--format", "openai"]
    result = invoke([*args, "--served-model-name", "acme/coder-7b"], env)
    assert result.exit_code == 0, result.output
    ran = read_lines(out)
    assert [line["custom_id"] for line in ran] == ["chat-1", "cmpl-1", "plain"]
    assert [line["response"]["body"]["model"] for line in ran] == ["acme/coder-7b"] * 3
    assert (
        ChatCompletion.model_validate(ran[0]["response"]["body"]).choices[0].message.content
        == (lines[0]["response"]["body"]["choices"][0]["message"]["content"])
    )
    result = invoke(args, env)  # no served name: each line's own
    assert [line["response"]["body"]["model"] for line in read_lines(out)] == [
        MODEL,
        "davinci-002",
        os.path.basename(tiny_pair[0]),
    ]


def test_completed_only_and_errors_only_split_the_job(env, finished_job, tmp_path) -> None:
    for fmt in ("openai", "jsonl"):
        done = export(env, finished_job, tmp_path / f"done.{fmt}.jsonl", "--format", fmt, "--completed-only")
        errors = export(env, finished_job, tmp_path / f"errors.{fmt}.jsonl", "--format", fmt, "--errors-only")
        key = "custom_id" if fmt == "openai" else "id"
        assert [line[key] for line in done] == ["chat-1", "cmpl-1", "plain"]
        assert [line[key] for line in errors] == ["too-long"]
    result = invoke(["export", finished_job, "-o", str(tmp_path / "x.csv"), "--completed-only"], env)
    assert result.exit_code == 0 and (tmp_path / "x.csv").read_text(encoding="utf-8").count("\n") == 4
    result = invoke(["export", finished_job, "-o", str(tmp_path / "y.csv"), "--completed-only", "--errors-only"], env)
    assert result.exit_code == 2 and "exclude each other" in result.stderr


def test_a_cancelled_job_exports_batch_cancelled(pg_db_url, redis_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, redis_url, tmp_path / "home")  # a broker and no worker: nothing runs
    job_id = submit_job(env, write_requests(tmp_path / "in.jsonl", LINES[:2]), "--target", tiny_pair[0])
    assert invoke(["cancel", job_id], env).exit_code == 0
    lines = export(env, job_id, tmp_path / "errors.jsonl", "--format", "openai", "--errors-only")
    assert [(line["custom_id"], line["response"], line["error"]["code"]) for line in lines] == [
        ("chat-1", None, "batch_cancelled"),
        ("cmpl-1", None, "batch_cancelled"),
    ]
    assert export(env, job_id, tmp_path / "done.jsonl", "--format", "openai", "--completed-only") == []


def test_status_has_usage_totals_and_both_rates(env, finished_job, tmp_path) -> None:
    info = job_status(env, finished_job)
    lines = export(env, finished_job, tmp_path / "all.jsonl", "--format", "jsonl")
    prompt = sum(line["prompt_tokens"] for line in lines)
    completion = sum(line["completion_tokens"] for line in lines)
    assert info["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    assert info["wall_tokens_per_second"] == info["tokens_per_second"] > 0
    # the engine's own rate leaves out model loading and queueing, so it is the faster of the two
    assert info["engine_tokens_per_second"] > info["wall_tokens_per_second"]
    text = invoke(["status", finished_job], env)
    assert text.exit_code == 0 and "usage" in text.stdout and "engine_tokens_per_second" in text.stdout


def test_status_filters_the_job_list_by_state_and_age(env, finished_job, pg_db_url) -> None:
    from sqlalchemy import update

    from specq.db.models import Job
    from specq.db.session import open_database

    def listed(*args: str) -> list[str]:
        result = invoke(["status", "--json", *args], env)
        assert result.exit_code == 0, result.output
        return [job["id"] for job in json.loads(result.stdout)]

    assert listed("--state", "completed") == [finished_job]
    assert listed("--state", "running") == []
    assert listed("--since", "1h") == [finished_job]
    with open_database(pg_db_url).session() as session:  # make it two days old
        session.execute(update(Job).values(created_at=datetime(2000, 1, 1, tzinfo=UTC)))
    assert listed("--since", "1d") == [] and listed("--since", "30000w") == [finished_job]
    for bad in ("1x", "-1h", "h", "nanh"):
        result = invoke(["status", "--since", bad], env)
        assert result.exit_code == 2 and f"{bad!r} is not a duration" in result.stderr, result.output
    result = invoke(["status", finished_job, "--state", "completed"], env)
    assert result.exit_code == 2 and "without JOB" in result.stderr
    result = invoke(["status", "--state", "lost"], env)
    assert result.exit_code == 2
