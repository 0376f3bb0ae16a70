"""The queue path end to end: real PostgreSQL, real Redis, one real `specq worker` process for the module.

submit -> worker -> status/export with both input forms, checked token for token against the engine run
directly on the target (and against `specq run`), per-request failures, a job cancelled while it runs,
retry of failed requests, workers listing and Prometheus metrics. The models are conftest's tiny pair.
"""

from __future__ import annotations

import csv
import io
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result as CliResult
from sqlalchemy import func, select

from specq.cli.main import cli
from specq.db.models import Request, Result
from specq.db.session import open_database
from tests.services import (
    REDIS_TEST_URL,
    SpecqWorker,
    count_rows,
    empty_database,
    flush_redis,
    flushed_redis,
    invoke,
    job_status,
    reference_greedy,
    request_states,
    services_env,
    wait_state,
    write_requests,
)

METRICS_PORT = 19731
PLAIN = {"id": "p1", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}
CHAT: dict[str, Any] = {
    "custom_id": "c1",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"model": "x", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0},
}
OPENAI_COMPLETION = {
    "custom_id": "o1",
    "method": "POST",
    "url": "/v1/completions",
    "body": {"model": "x", "prompt": "class Point:", "max_tokens": 7, "temperature": 0},
}
TOO_LONG = {"id": "long", "prompt": "for i in range(10):", "max_tokens": 1000}  # the context is 256
SAMPLED = {"id": "s1", "prompt": "print(i,", "max_tokens": 5, "temperature": 0.9, "seed": 7}
GREEDY_MORE = [{"prompt": f"def mul{i}(a, b):", "max_tokens": 6 + i % 4, "temperature": 0} for i in range(6)]
LINES: list[dict[str, Any]] = [PLAIN, CHAT, OPENAI_COMPLETION, TOO_LONG, SAMPLED, *GREEDY_MORE]


@pytest.fixture(scope="module")
def env(pg_url, tmp_path_factory):
    """This module's services, emptied once, and one worker serving them for every test."""
    empty_database(pg_url)
    flushed_redis(REDIS_TEST_URL).close()
    home = tmp_path_factory.mktemp("queue_home")
    environment = services_env(pg_url, REDIS_TEST_URL, home)
    worker = SpecqWorker(environment, home / "worker.log", metrics_port=METRICS_PORT).wait_ready()
    yield environment
    assert worker.stop() == 0, worker.output()
    assert "Traceback" not in worker.output(), worker.output()
    flush_redis(REDIS_TEST_URL).close()


def submit(env, tmp_path: Path, lines: list, *args: str) -> tuple[str, CliResult]:
    path = write_requests(tmp_path / "in.jsonl", lines)
    result = invoke(["submit", path, *args], env)
    return result.stdout.strip(), result


def test_submit_worker_export_matches_direct_greedy(env, tiny_pair, tmp_path) -> None:
    args = ("--target", tiny_pair[0], "--draft", tiny_pair[1], "--batch-size", "4", "--wait")
    job_id, result = submit(env, tmp_path, LINES, *args)
    assert result.exit_code == 1, result.output  # LINES has one request too long for the model
    assert result.stdout == job_id + "\n" and job_id.isalnum()  # the job id alone on stdout
    assert "completed" in result.stderr

    info = job_status(env, job_id)
    assert info["id"] == job_id and info["state"] == "completed"
    assert (info["total"], info["completed"], info["failed"]) == (len(LINES), len(LINES) - 1, 1)
    assert info["generated_tokens"] > 0 and info["tokens_per_second"] > 0
    assert 0.0 <= info["acceptance_rate"] <= 1.0 and info["num_draft_tokens"] > 0
    assert info["mean_acceptance_length"] >= 1.0 and len(info["acceptance_per_position"]) == 4
    listing = json.loads(invoke(["status", "--json"], env).stdout)
    assert listing[0]["id"] == job_id  # newest first
    assert invoke(["status", job_id], env).exit_code == 0  # the human form too

    expected = reference_greedy(tiny_pair[0], LINES)
    ids = [str(line.get("id") or line.get("custom_id") or n) for n, line in enumerate(LINES, start=1)]

    out = tmp_path / "out.jsonl"
    result = invoke(["export", job_id, "-o", str(out), "--format", "jsonl"], env)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == ids  # input order
    by_id = {r["id"]: r for r in records}
    for request_id, tokens in expected.items():
        assert by_id[request_id]["tokens"] == tokens, request_id
        assert by_id[request_id]["completion_tokens"] == len(tokens)
        assert by_id[request_id]["finish_reason"] in ("stop", "length") and by_id[request_id]["error"] is None
    long = by_id["long"]
    assert long["completion"] is None and long["finish_reason"] is None
    assert "exceeds the model's context" in long["error"]

    out_csv = tmp_path / "out.csv"
    result = invoke(["export", job_id, "-o", str(out_csv)], env)
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(out_csv.read_text(encoding="utf-8"), newline="")))
    assert [r["id"] for r in rows] == ids
    assert [r["status"] for r in rows].count("failed") == 1
    chat = rows[ids.index("c1")]
    assert json.loads(chat["prompt"]) == CHAT["body"]["messages"]
    assert chat["completion"] == by_id["c1"]["completion"]
    assert rows[ids.index("long")]["error"] == long["error"]

    out_openai = tmp_path / "openai.jsonl"
    result = invoke(["export", job_id, "-o", str(out_openai), "--format", "openai"], env)
    assert result.exit_code == 0, result.output
    batch = {r["custom_id"]: r for r in map(json.loads, out_openai.read_text(encoding="utf-8").splitlines())}
    assert list(batch) == ids
    assert batch["c1"]["response"]["body"]["object"] == "chat.completion"
    assert batch["c1"]["response"]["body"]["choices"][0]["message"]["content"] == by_id["c1"]["completion"]
    assert batch["o1"]["response"]["body"]["object"] == "text_completion"
    assert batch["p1"]["response"]["body"]["choices"][0]["text"] == by_id["p1"]["completion"]
    assert batch["p1"]["response"]["body"]["model"] == "target"  # a local folder by its name, never its path
    overflow = batch["long"]["response"]  # answered as OpenAI answers a prompt past the context
    assert overflow["status_code"] == 400 and overflow["body"]["error"]["message"] == long["error"]

    # `specq run` on the same file (the lead's command): the greedy lines are the same, field for field
    if "run" in cli.commands:
        run_out = tmp_path / "run.jsonl"
        run = invoke(["run", str(tmp_path / "in.jsonl"), "-o", str(run_out), *args[:4]], env)
        assert run.exit_code == 1, run.output  # the too-long line failed
        ran = {r["id"]: r for r in map(json.loads, run_out.read_text(encoding="utf-8").splitlines())}
        keys = ("completion", "finish_reason", "prompt_tokens", "completion_tokens", "tokens", "error")
        for request_id in [*expected, "long"]:
            assert {k: ran[request_id][k] for k in keys} == {k: by_id[request_id][k] for k in keys}


def test_workers_and_metrics(env, tiny_pair, tmp_path) -> None:
    result = invoke(["workers", "--json"], env)
    assert result.exit_code == 0, result.output
    (worker,) = json.loads(result.stdout)
    assert worker["device"] == "cpu" and worker["state"] in ("idle", "busy") and worker["last_heartbeat"]
    assert worker["name"].startswith("worker@")
    assert invoke(["workers"], env).exit_code == 0

    _, result = submit(env, tmp_path, [PLAIN], "--target", tiny_pair[0], "--draft", tiny_pair[1], "--wait")
    assert result.exit_code == 0, result.output
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    for name in (
        "specq_spec_decode_num_drafts_total",
        "specq_spec_decode_num_draft_tokens_total",
        "specq_spec_decode_num_accepted_tokens_total",
        'specq_spec_decode_num_accepted_tokens_per_pos_total{device="cpu",model_name="',
        "specq_generation_tokens_total",
        "specq_prompt_tokens_reused_total",
        "specq_num_requests_running",
        "specq_num_requests_waiting",
        'specq_spec_decode_num_draft_tokens_by_proposer_total{device="cpu",model_name="',
        'proposer="draft"}',
        "specq_spec_decode_num_accepted_tokens_by_proposer_total",
    ):
        assert name in metrics, name


def test_per_request_failures_and_retry(env, tiny_pair, tmp_path) -> None:
    job_id, result = submit(env, tmp_path, [TOO_LONG, PLAIN], "--target", tiny_pair[0], "--wait")
    assert result.exit_code == 1, result.output  # one request failed; the job went on and completed
    assert "1 failed" in result.stderr
    result = invoke(["retry", job_id], env)
    assert result.exit_code == 0, result.output
    assert "1 request requeued" in result.output
    info = wait_state(env, job_id, {"completed", "failed"})
    assert (info["state"], info["completed"], info["failed"]) == ("completed", 1, 1)  # failed again, once
    with open_database(env["SPECQ_DATABASE_URL"]).session() as session:
        results = session.scalar(select(func.count()).select_from(Result).join(Request).where(Request.job_id == job_id))
    assert results == 2
    result = invoke(["cancel", job_id], env)
    assert result.exit_code == 2 and "already ended (completed)" in result.output


def test_job_of_failures_fails_and_wait_exits_1(env, tiny_pair, tmp_path) -> None:
    job_id, result = submit(env, tmp_path, [TOO_LONG], "--target", tiny_pair[0], "--wait")
    assert result.exit_code == 1, result.output
    assert f"job {job_id} failed" in result.output
    assert job_status(env, job_id)["state"] == "failed"


def test_the_jobs_chat_template_and_token_ids_reach_the_worker(env, tiny_pair, tmp_path) -> None:
    """--chat-template is stored with the job and the worker renders with it; prompt token ids are stored
    and run as given: the worker's prompt_tokens and completions equal `specq run`'s."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair[0])
    prompt_ids = tokenizer(PLAIN["prompt"])["input_ids"]
    body = {"prompt": prompt_ids, "max_tokens": 8, "temperature": 0}
    token_ids = {"custom_id": "t1", "method": "POST", "url": "/v1/completions", "body": body}
    lines = [CHAT, token_ids]
    args = ("--target", tiny_pair[0], "--chat-template", str(template))
    job_id, result = submit(env, tmp_path, lines, *args, "--wait")
    assert result.exit_code == 0, result.output
    out, run_out = tmp_path / "out.jsonl", tmp_path / "run.jsonl"
    assert invoke(["export", job_id, "-o", str(out), "--format", "jsonl"], env).exit_code == 0
    assert invoke(["run", str(tmp_path / "in.jsonl"), "-o", str(run_out), *args], env).exit_code == 0
    stored, ran = ({r["id"]: r for r in map(json.loads, f.read_text().splitlines())} for f in (out, run_out))
    rendered = tokenizer("[user] hello\n")["input_ids"]
    assert stored["c1"]["prompt_tokens"] == ran["c1"]["prompt_tokens"] == len(rendered)
    assert stored["t1"]["prompt_tokens"] == ran["t1"]["prompt_tokens"] == len(prompt_ids)
    for request_id in ("c1", "t1"):
        assert stored[request_id]["tokens"] == ran[request_id]["tokens"]


def test_cancel_while_running(env, tiny_pair, tmp_path) -> None:
    # far more work than runs before the cancel lands (the rest is skipped, so its size costs nothing)
    lines = [{"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 100, "temperature": 0} for i in range(48)]
    job_id, result = submit(env, tmp_path, lines, "--target", tiny_pair[0], "--batch-size", "2")
    assert result.exit_code == 0, result.output
    deadline = time.monotonic() + 60
    while job_status(env, job_id)["completed"] == 0:  # wait until the worker is into the job
        assert time.monotonic() < deadline
        time.sleep(0.05)
    result = invoke(["cancel", job_id], env)
    assert result.exit_code == 0, result.output
    db = open_database(env["SPECQ_DATABASE_URL"])
    deadline = time.monotonic() + 30
    while True:  # the worker sees the cancel at its next write and gives up the rest of its chunk
        with db.session() as session:
            states = request_states(session, job_id)
        if "running" not in states:
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.1)
    info = job_status(env, job_id)
    assert info["state"] == "cancelled"
    assert states.get("cancelled", 0) > 0 and states.get("completed", 0) == info["completed"] > 0
    assert sum(states.values()) == 48
    assert count_rows(env["SPECQ_DATABASE_URL"], Result) >= info["completed"]
    out = tmp_path / "cancelled.csv"
    assert invoke(["export", job_id, "-o", str(out)], env).exit_code == 0
    with out.open(newline="", encoding="utf-8") as f:
        statuses = [row["status"] for row in csv.DictReader(f)]
    assert set(statuses) == {"completed", "cancelled"}


def test_a_draft_model_pair_through_the_queue(env, tiny_pair, tmp_path) -> None:
    """A target and a draft model (tiny_pair: built in seconds) through the queue: greedy outputs are the
    target's own, draft counters stored."""
    target, draft = tiny_pair
    prompts = ["def read_file(path):\n", "class Stack:\n    def push(self, item):\n", "import os\n\ndef main():\n"]
    lines = [{"id": f"d{i}", "prompt": p, "max_tokens": 24, "temperature": 0} for i, p in enumerate(prompts)]
    job_id, result = submit(env, tmp_path, lines, "--target", target, "--draft", draft, "--fixed-k", "--wait")
    assert result.exit_code == 0, result.output
    info = job_status(env, job_id)
    assert info["completed"] == len(lines) and info["num_draft_tokens"] > 0, info
    assert 0.0 <= info["acceptance_rate"] <= 1.0
    out = tmp_path / "pair.jsonl"
    assert invoke(["export", job_id, "-o", str(out)], env).exit_code == 0
    expected = reference_greedy(target, lines)
    for record in map(json.loads, out.read_text(encoding="utf-8").splitlines()):
        assert record["tokens"] == expected[record["id"]], record["id"]
