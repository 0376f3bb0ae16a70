"""Log-probabilities: each output token's and its top N, from the verify pass, must equal the target's
own log-softmax over its logits for that position (a plain transformers forward of prompt + output),
whatever the batch, the draft, the sampling or the stop that cut the output."""

from __future__ import annotations

import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from tests.tiny_models import IdTokenizer, noisy_copy, tiny_llama

PROMPTS = [[5, 9, 3, 12, 7, 22, 30, 2, 11], [4, 8], [17, 3, 3, 25, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab=64, seed=3, sharpness=2.0)  # soft: sampled outputs wander, top-N entries differ


def reference(target, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V]: the target's log-softmax at each output position, by one plain forward."""
    with torch.no_grad():
        logits = target(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1], dim=-1)


def decode(target, draft, params: list[SamplingParams], batch_size: int):
    requests = [GenerationRequest(i, tuple(p), q) for i, (p, q) in enumerate(zip(PROMPTS, params, strict=True))]
    config = DecodingConfig(num_speculative_tokens=3, batch_size=batch_size, strict=True)
    return {r.key: r for r in SpeculativeEngine(target, IdTokenizer(), draft, config).generate(requests)}


@pytest.mark.parametrize("with_draft", [False, True], ids=["target-only", "speculative"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_logprobs_equal_a_plain_forward(target, with_draft, batch_size) -> None:
    draft = noisy_copy(target, scale=0.05) if with_draft else None
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, logprobs=3),
        SamplingParams(max_tokens=9, temperature=0.8, seed=7, logprobs=0),
        SamplingParams(max_tokens=10, temperature=1.3, top_k=5, seed=3, logprobs=20),
        SamplingParams(max_tokens=8, temperature=0.5, seed=1),  # asks nothing: gets nothing
    ]
    results = decode(target, draft, params, batch_size)
    assert results[3].logprobs is None
    for key in range(3):
        result, wanted = results[key], params[key].logprobs
        assert result.error is None and result.logprobs is not None
        assert [entry.token_id for entry in result.logprobs] == result.token_ids
        expected = reference(target, PROMPTS[key], result.token_ids)  # [tokens, V]
        for position, entry in enumerate(result.logprobs):
            assert entry.logprob == pytest.approx(float(expected[position, entry.token_id]), abs=1e-4)
            assert entry.token == f"<{entry.token_id}>"
            assert len(entry.top) == wanted
            values, ids = expected[position].topk(wanted) if wanted else (torch.zeros(0), torch.zeros(0))
            assert [lp for _, _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
            # ids may swap only between (near) ties
            for (token_id, _, lp), want in zip(entry.top, ids.tolist(), strict=True):
                assert token_id == want or abs(lp - float(expected[position, want])) < 1e-4


def test_logprobs_are_cut_with_the_output_by_a_stop_string(target) -> None:
    free = decode(target, None, [SamplingParams(max_tokens=12, temperature=0.0, logprobs=1)] * 4, batch_size=4)
    tokens = free[0].token_ids
    stop = f"<{tokens[4]}>"
    cut = decode(target, None, [SamplingParams(max_tokens=12, temperature=0.0, stop=(stop,), logprobs=1)] * 4, 4)[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(tokens)
    assert cut.logprobs is not None and len(cut.logprobs) == len(cut.token_ids)
    assert cut.logprobs == free[0].logprobs[: len(cut.token_ids)]


def test_the_logprobs_setting_is_bounded() -> None:
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=bad)


# -- from the input line to the export, through a real worker -------------------------------------------
def openai_line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}


PROMPT_IDS = [72, 101, 108, 108, 111, 44, 32]
LOGPROB_LINES = [
    openai_line("cmpl", "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "logprobs": 3}),
    openai_line(
        "chat",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "logprobs": True, "top_logprobs": 2},
    ),
    openai_line("none", "/v1/completions", {"prompt": "def", "max_tokens": 3, "logprobs": None}),
    {"id": "plain", "prompt": "class A:", "max_tokens": 4, "temperature": 0, "logprobs": 1},
]


def test_logprob_fields_of_openai_and_plain_lines(tmp_path) -> None:
    from specq.errors import BadInputError
    from specq.jobs.inputs import iter_request_specs, validate_file
    from tests.services import write_requests

    path = write_requests(tmp_path / "in.jsonl", LOGPROB_LINES)
    assert [spec.overrides.get("logprobs") for spec in iter_request_specs(path)] == [3, 2, None, 1]
    chat_only = openai_line("c", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    bad = [
        (openai_line("a", "/v1/completions", {"prompt": "x", "logprobs": 6}), '"body.logprobs" must be'),
        (openai_line("b", "/v1/completions", {"prompt": "x", "logprobs": True}), '"body.logprobs" must be an integer'),
        ({**chat_only, "body": {**chat_only["body"], "logprobs": 1}}, '"body.logprobs" must be true or false'),
        ({**chat_only, "body": {**chat_only["body"], "top_logprobs": 2}}, 'needs "body.logprobs": true'),
        ({**chat_only, "body": {**chat_only["body"], "logprobs": True, "top_logprobs": 21}}, "top_logprobs"),
        ({"prompt": "x", "logprobs": 21}, '"logprobs" must be'),
        (openai_line("e", "/v1/completions", {"prompt": "x", "top_logprobs": 2}), "is not a field of /v1/completions"),
    ]
    for line, says in bad:
        with pytest.raises(BadInputError) as info:
            validate_file(write_requests(tmp_path / "bad.jsonl", [line]))
        assert says in info.value.problems[0], info.value.problems


def test_logprobs_through_a_worker_validate_and_equal_a_forward(
    pg_db_url, redis_url, tiny_pair, start_worker, tmp_path
) -> None:
    import json

    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    from transformers import AutoModelForCausalLM

    from tests.services import invoke, services_env, submit_job, wait_state, write_requests

    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", LOGPROB_LINES)
    job_id = submit_job(env, path, "--target", tiny_pair[0], "--draft", tiny_pair[1])
    start_worker(env)
    assert wait_state(env, job_id, {"completed", "failed"})["completed"] == 4
    out = tmp_path / "out.jsonl"
    assert invoke(["export", job_id, "-o", str(out), "--format", "openai"], env).exit_code == 0
    lines = {line["custom_id"]: line for line in map(json.loads, out.read_text(encoding="utf-8").splitlines())}

    completion = Completion.model_validate(lines["cmpl"]["response"]["body"])
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)  # tokens that decode alike share a key
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    chat = ChatCompletion.model_validate(lines["chat"]["response"]["body"])
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.bytes == list(entry.token.encode()) for entry in content)
    assert lines["none"]["response"]["body"]["choices"][0]["logprobs"] is None

    # the values: the target's own log-softmax at each output position
    plain = tmp_path / "plain.jsonl"
    assert invoke(["export", job_id, "-o", str(plain), "--format", "jsonl"], env).exit_code == 0
    records = {r["id"]: r for r in map(json.loads, plain.read_text(encoding="utf-8").splitlines())}
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    expected = reference(model, PROMPT_IDS, records["cmpl"]["tokens"])
    for position, (token_id, logprob) in enumerate(
        zip(records["cmpl"]["tokens"], logprobs.token_logprobs, strict=True)
    ):
        assert logprob == pytest.approx(float(expected[position, token_id]), abs=1e-4)
    assert [entry["logprob"] for entry in records["cmpl"]["logprobs"]] == logprobs.token_logprobs

    # `specq run` writes the same numbers
    ran = tmp_path / "ran.jsonl"
    result = invoke(["run", path, "-o", str(ran), "--target", tiny_pair[0], "--format", "openai"], env)
    assert result.exit_code == 0, result.output
    run_lines = {line["custom_id"]: line for line in map(json.loads, ran.read_text(encoding="utf-8").splitlines())}
    run_logprobs = run_lines["cmpl"]["response"]["body"]["choices"][0]["logprobs"]["token_logprobs"]
    assert run_logprobs == pytest.approx(logprobs.token_logprobs, abs=1e-5)


def test_logprobs_survive_row_reuse_compaction_and_a_wider_top(target) -> None:
    """Rows freed and refilled, the batch compacted, and a later request wanting more alternatives than
    the buffers held (they grow): each request's log-probabilities are still its own."""
    prompts = [[5 + i, 9, 11 + i][: 1 + i % 3] for i in range(7)]
    tops = [None, 0, 2, None, 20, 1, 5]
    requests = [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=4 + 3 * (i % 3), temperature=0.0, logprobs=top))
        for i, (p, top) in enumerate(zip(prompts, tops, strict=True))
    ]
    engine = SpeculativeEngine(target, IdTokenizer(), None, DecodingConfig(batch_size=2, strict=True))
    results = {r.key: r for r in engine.generate(requests)}
    for i, (prompt, top) in enumerate(zip(prompts, tops, strict=True)):
        result = results[i]
        if top is None:
            assert result.logprobs is None
            continue
        assert result.logprobs is not None
        expected = reference(target, prompt, result.token_ids)
        for position, entry in enumerate(result.logprobs):
            assert entry.token_id == result.token_ids[position]
            assert entry.logprob == pytest.approx(float(expected[position, entry.token_id]), abs=1e-4)
            assert [lp for _, _, lp in entry.top] == pytest.approx(
                expected[position].topk(top).values.tolist(), abs=1e-4
            )
