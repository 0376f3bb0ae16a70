"""Log-probabilities through the commands: `specq run`, and `specq submit` + a real worker on PostgreSQL
and Redis, exported in OpenAI's shapes (validated with the `openai` package's own types)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from transformers import AutoModelForCausalLM

from tests.services import REDIS_TEST_URL, empty_database, flushed_redis, invoke, services_env, write_requests

LINES: list[dict[str, Any]] = [
    {"id": "plain", "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0, "logprobs": 2},
    {"id": "none", "prompt": "class A:", "max_tokens": 4, "temperature": 0},
    {
        "custom_id": "cmpl",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "for i in", "max_tokens": 5, "temperature": 0.8, "seed": 3, "logprobs": 5},
    },
    {
        "custom_id": "chat",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        },
    },
]
TOPS = {"plain": 2, "cmpl": 5, "chat": 3}


def _check_against_forward(target_dir: str, record: dict, prompt_ids: list[int], top: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokens = record["tokens"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + tokens])).logits[0].float()
    reference = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(tokens)].log_softmax(-1)
    assert [e["token_id"] for e in record["logprobs"]] == tokens
    for position, entry in enumerate(record["logprobs"]):
        assert entry["logprob"] == pytest.approx(float(reference[position, tokens[position]]), abs=1e-4)
        values, ids = reference[position].topk(top)
        assert [i for i, _ in entry["top"]] == ids.tolist()
        assert [v for _, v in entry["top"]] == pytest.approx(values.tolist(), abs=1e-4)


def test_run_writes_logprobs_of_the_target(tiny_pair, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES)
    out = tmp_path / "out.jsonl"
    result = invoke(["run", path, "-o", str(out), "--target", tiny_pair[0], "--draft", tiny_pair[1]])
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert "logprobs" not in records["none"]  # asked for nothing, pays nothing
    from specq.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_pair[0])
    for request_id in ("plain", "cmpl"):
        prompt = next(line for line in LINES if request_id in (line.get("id"), line.get("custom_id")))
        text = prompt.get("prompt") or prompt["body"]["prompt"]
        _check_against_forward(tiny_pair[0], records[request_id], tokenizer(text)["input_ids"], TOPS[request_id])
    assert len(records["chat"]["logprobs"]) == records["chat"]["completion_tokens"]


def test_submit_worker_export_openai_logprobs(pg_url, tiny_pair, tmp_path, start_worker) -> None:
    empty_database(pg_url)
    client = flushed_redis(REDIS_TEST_URL)
    env = services_env(pg_url, REDIS_TEST_URL, tmp_path / "home")
    start_worker(env)
    path = write_requests(tmp_path / "in.jsonl", LINES)
    result = invoke(["submit", path, "--target", tiny_pair[0], "--draft", tiny_pair[1], "--wait"], env)
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip()

    out = tmp_path / "out.jsonl"
    assert invoke(["export", job_id, "-o", str(out), "--format", "jsonl"], env).exit_code == 0
    records = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    ran = tmp_path / "run.jsonl"
    run = invoke(["run", path, "-o", str(ran), "--target", tiny_pair[0], "--draft", tiny_pair[1]])
    assert run.exit_code == 0, run.output
    direct = {r["id"]: r for r in map(json.loads, ran.read_text(encoding="utf-8").splitlines())}
    for request_id in ("plain", "chat"):  # greedy: the same tokens, the same log-probabilities
        assert records[request_id]["tokens"] == direct[request_id]["tokens"]
        for stored, local in zip(records[request_id]["logprobs"], direct[request_id]["logprobs"], strict=True):
            assert stored["token_id"] == local["token_id"]
            assert stored["logprob"] == pytest.approx(local["logprob"], abs=1e-4)
    assert "logprobs" not in records["none"]

    batch_out = tmp_path / "openai.jsonl"
    assert invoke(["export", job_id, "-o", str(batch_out), "--format", "openai"], env).exit_code == 0
    lines = {r["custom_id"]: r for r in map(json.loads, batch_out.read_text(encoding="utf-8").splitlines())}
    chat = ChatCompletion.model_validate(lines["chat"]["response"]["body"])
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == records["chat"]["completion_tokens"]
    assert all(len(token.top_logprobs) == 3 for token in content)
    assert [token.logprob for token in content] == [e["logprob"] for e in records["chat"]["logprobs"]]
    assert all(token.bytes == list(token.token.encode("utf-8")) for token in content)
    for request_id in ("plain", "cmpl"):
        completion = Completion.model_validate(lines[request_id]["response"]["body"])
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
        assert logprobs.token_logprobs == [e["logprob"] for e in records[request_id]["logprobs"]]
        assert all(len(top) <= TOPS[request_id] for top in logprobs.top_logprobs)
        offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
        assert logprobs.text_offset == offsets
    none = Completion.model_validate(lines["none"]["response"]["body"])
    assert none.choices[0].logprobs is None
    client.flushdb()


def test_embedded_sqlite_stores_logprobs(tiny_pair, tmp_path) -> None:
    """No services: the job runs inside `submit` (SQLite) and stores the same log-probabilities."""
    env = {"SPECQ_HOME": str(tmp_path / "home")}
    path = write_requests(tmp_path / "in.jsonl", LINES[:2])
    result = invoke(["submit", path, "--target", tiny_pair[0], "--wait"], env)
    assert result.exit_code == 0, result.output
    out = tmp_path / "out.jsonl"
    assert invoke(["export", result.stdout.strip(), "-o", str(out)], env).exit_code == 0
    records = {r["id"]: r for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert [e["token_id"] for e in records["plain"]["logprobs"]] == records["plain"]["tokens"]
    assert all(len(e["top"]) == 2 for e in records["plain"]["logprobs"])
    assert "logprobs" not in records["none"]
