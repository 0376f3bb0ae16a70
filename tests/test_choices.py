"""`n` > 1: a line asks for several completions of one prompt. Each is a request of its own (its choice
index, a seed of its own when the line is seeded), and OpenAI-format output gathers them into one line's
`choices`, with the prompt counted once in the usage."""

from __future__ import annotations

import csv
import json
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from specq.errors import BadInputError
from specq.jobs.inputs import iter_request_specs, validate_file
from specq.jobs.params import choice_overrides
from tests.services import invoke, job_status, services_env, submit_job, write_requests

SEEDED: dict[str, Any] = {
    "custom_id": "seeded",
    "method": "POST",
    "url": "/v1/completions",
    "body": {"model": "m", "prompt": "def", "max_tokens": 12, "temperature": 1.5, "seed": 11, "n": 3},
}
CHAT: dict[str, Any] = {
    "custom_id": "chat",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0, "n": 2},
}
PLAIN = {"id": "plain", "prompt": "class A:", "max_tokens": 4, "temperature": 0}
LINES = [SEEDED, CHAT, PLAIN]


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_n_is_read_and_bounded(tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", [*LINES, {"prompt": "x", "n": 5}])
    assert [spec.n for spec in iter_request_specs(path)] == [3, 2, 1, 5]
    for bad, says in ((0, "must be"), (129, "must be"), ("2", "must be an integer"), (True, "must be an integer")):
        line = {**SEEDED, "body": {**SEEDED["body"], "n": bad}}
        with pytest.raises(BadInputError) as info:
            validate_file(write_requests(tmp_path / "bad.jsonl", [line]))
        assert f'"body.n" {says}' in info.value.problems[0]


def test_choice_seeds_differ_and_choice_0_keeps_the_line_seed() -> None:
    seeds = [choice_overrides({"seed": 2**63 - 1}, i)["seed"] for i in range(128)]
    assert seeds[0] == 2**63 - 1 and len(set(seeds)) == 128 and all(0 <= s < 2**63 for s in seeds)
    assert choice_overrides({"temperature": 1.0}, 3) == {"temperature": 1.0}  # unseeded: each draws its own


def test_a_job_with_n_exports_one_line_with_its_choices(pg_db_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, None, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", LINES)
    job_id = submit_job(env, path, "--target", tiny_pair[0], "--draft", tiny_pair[1], "--wait")
    info = job_status(env, job_id)
    assert (info["total"], info["completed"]) == (6, 6)  # a request a choice

    out = tmp_path / "out.jsonl"
    assert invoke(["export", job_id, "-o", str(out), "--format", "openai"], env).exit_code == 0
    lines = {line["custom_id"]: line for line in read_lines(out)}
    assert list(lines) == ["seeded", "chat", "plain"]
    seeded = Completion.model_validate(lines["seeded"]["response"]["body"])
    assert [choice.index for choice in seeded.choices] == [0, 1, 2]
    texts = [choice.text for choice in seeded.choices]
    assert len(set(texts)) > 1  # each choice samples with its own seed
    chat = ChatCompletion.model_validate(lines["chat"]["response"]["body"])
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same

    plain = tmp_path / "plain.jsonl"
    assert invoke(["export", job_id, "-o", str(plain), "--format", "jsonl"], env).exit_code == 0
    records = read_lines(plain)
    assert [(r["id"], r.get("choice")) for r in records] == [
        ("seeded", 0),
        ("seeded", 1),
        ("seeded", 2),
        ("chat", 0),
        ("chat", 1),
        ("plain", None),
    ]
    assert seeded.usage is not None
    assert seeded.usage.prompt_tokens == records[0]["prompt_tokens"]  # the prompt once
    assert seeded.usage.completion_tokens == sum(r["completion_tokens"] for r in records[:3])
    assert [r["completion"] for r in records[:3]] == texts

    table = tmp_path / "out.csv"
    assert invoke(["export", job_id, "-o", str(table)], env).exit_code == 0
    with open(table, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert [(row["id"], row["choice"]) for row in rows][:3] == [("seeded", "0"), ("seeded", "1"), ("seeded", "2")]

    # seeded: the same line, alone or with n = 1, run anywhere, gives choice 0 again; `run` gives all three
    alone = write_requests(tmp_path / "alone.jsonl", [{**SEEDED, "body": {**SEEDED["body"], "n": 1}}])
    ran = tmp_path / "ran.jsonl"
    result = invoke(["run", alone, "-o", str(ran), "--target", tiny_pair[0], "--format", "openai"], env)
    assert result.exit_code == 0, result.output
    assert [c["text"] for c in read_lines(ran)[0]["response"]["body"]["choices"]] == texts[:1]
    result = invoke(["run", path, "-o", str(ran), "--target", tiny_pair[0], "--format", "openai"], env)
    assert result.exit_code == 0, result.output
    run_lines = {line["custom_id"]: line for line in read_lines(ran)}
    assert [c["text"] for c in run_lines["seeded"]["response"]["body"]["choices"]] == texts
    assert len(run_lines["chat"]["response"]["body"]["choices"]) == 2


def test_rows_with_one_prompt_share_the_targets_prefill() -> None:
    """A line's choices are rows with one prompt: the target reads it once, the other rows copy its cache
    columns, and each row decodes what it decodes alone."""
    from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
    from tests.tiny_models import IdTokenizer, noisy_copy, tiny_llama

    target = tiny_llama(vocab=64, seed=3, sharpness=2.0)
    prompt, other = (5, 9, 3, 12, 7, 22, 30), (4, 8, 13)
    prompts = [prompt, prompt, other, prompt]
    for draft in (None, noisy_copy(target, scale=0.05)):
        config = DecodingConfig(num_speculative_tokens=3, batch_size=4, sampling="reproducible", strict=True)
        params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, logprobs=2) for i in range(4)]
        requests = [GenerationRequest(i, p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))]
        engine = SpeculativeEngine(target, IdTokenizer(), draft, config)
        together = {r.key: r for r in engine.generate(requests)}
        read = len(prompt) + len(other)  # each prompt once, all of it (the prefill emits the first token)
        assert engine.stats.prefill_tokens == read
        for request in requests:
            alone = next(iter(SpeculativeEngine(target, IdTokenizer(), draft, config).generate([request])))
            assert together[request.key].token_ids == alone.token_ids
            mine_all, theirs_all = together[request.key].logprobs, alone.logprobs
            assert mine_all is not None and theirs_all is not None
            for mine, theirs in zip(mine_all, theirs_all, strict=True):
                assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert len({tuple(together[i].token_ids) for i in (0, 1, 3)}) > 1  # the seeds still differ
