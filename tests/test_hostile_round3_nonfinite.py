"""Hostile weights, third round (issue 49, item 10): weights that make the logits NaN or infinite.

A target whose logits are not finite has no distribution to decode from: the argmax of NaN is whatever
index the kernel returns (token 0 on a CPU), and a sample of it lands past the vocabulary. The request
fails, alone, with the token it happened at; the other requests of its batch decode as they would
without it (target-only output, greedy and sampled, with and without a draft), and a row it leaves is
clean for the next request. A draft's non-finite distributions are rejected: its tokens never reach the
output, so the output is still the target's.

The weights are poisoned by one token's embedding: NaN for token `poison`, so a sequence goes NaN from
the first position that reads it, and only the requests whose prompt or output holds it are touched.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from tests.services import invoke, write_requests
from tests.tiny_models import IdTokenizer, reference_greedy

# the first request is the one poisoned: its completion is long and runs to max_tokens (no EOS) in every
# mode; the others' are short, so that some token of its completion is in no other request
PROMPTS = ([33, 30, 60], [34, 18, 19], [20, 46, 25, 23])
MAX_TOKENS = (16, 6, 6)
SAMPLED = {"temperature": 0.9}


def _poisoned(model, token: int):
    """A copy of `model` whose embedding of `token` is NaN."""
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.model.embed_tokens.weight[token] = float("nan")
    return broken


def _requests(prompts, sampling=None):
    params = sampling or {"temperature": 0.0}
    return [
        GenerationRequest(key, tuple(prompt), SamplingParams(max_tokens=max_tokens, seed=100 + key, **params))
        for key, (prompt, max_tokens) in enumerate(zip(prompts, MAX_TOKENS, strict=True))
    ]


def _run(target, draft, requests, **config):
    config = {"strict": True, "num_speculative_tokens": 3, "fixed_k": True, **config}
    engine = SpeculativeEngine(target, IdTokenizer(), draft, DecodingConfig(**config))
    return {result.key: result for result in engine.generate(requests)}


def _poison_in_output(clean, poisoned_key: int, prompts) -> tuple[int, int]:
    """A token of request `poisoned_key`'s clean output (its index, at least 2, so a step decodes it) that
    no other request's prompt or output holds, nor its own prompt or earlier output: (token, index)."""
    others = {t for key, result in clean.items() if key != poisoned_key for t in result.token_ids}
    others |= {t for prompt in prompts for t in prompt}
    output = clean[poisoned_key].token_ids
    for index in range(2, len(output)):
        if output[index] not in others and output[index] not in output[:index]:
            return output[index], index
    raise AssertionError(f"no token of {output} is the poisoned request's alone")


def _assert_failed_at(result, token: int) -> None:
    assert result.error == (
        f"the target model produced non-finite logits (NaN or inf) at token {token} of the completion"
    ), result
    assert result.token_ids == [] and result.finish_reason is None


# -- the target ------------------------------------------------------------------------------------
MODES = [
    pytest.param({}, None, id="greedy"),
    pytest.param({}, "draft", id="greedy-draft"),
    pytest.param({"sampling_params": SAMPLED}, None, id="sampled"),
    pytest.param({"sampling_params": SAMPLED}, "draft", id="sampled-draft"),
    pytest.param({"sampling_params": SAMPLED, "sampling": "reproducible"}, "draft", id="reproducible-draft"),
]


def _mode(mode: dict, with_draft, draft):
    config = {k: v for k, v in mode.items() if k != "sampling_params"}
    return mode.get("sampling_params"), (draft if with_draft else None), config


@pytest.mark.parametrize(("mode", "with_draft"), MODES)
def test_nan_logits_mid_completion_fail_that_request_alone(target, draft, mode, with_draft) -> None:
    sampling, any_draft, config = _mode(mode, with_draft, draft)
    requests = _requests(PROMPTS, sampling)
    clean = _run(target, any_draft, requests, **config)
    poison, index = _poison_in_output(clean, 0, PROMPTS)

    results = _run(_poisoned(target, poison), any_draft, requests, **config)

    # the poisoned token is the completion's token index + 1; the logits after it are NaN. With a draft the
    # target may read it earlier, as a draft token: its NaN key reaches every query of the row's verify
    # (a masked NaN score is still NaN), so the request fails at that step, never with a wrong token.
    if any_draft is None:
        _assert_failed_at(results[0], index + 2)
    else:
        assert results[0].error is not None and results[0].token_ids == []
        failed_at = int(results[0].error.split(" at token ")[1].split()[0])
        assert 1 < failed_at <= index + 2
        _assert_failed_at(results[0], failed_at)
    for key in (1, 2):
        assert results[key].error is None
        assert results[key].token_ids == clean[key].token_ids, key
    if sampling is None:
        assert [results[k].token_ids for k in (1, 2)] == [
            reference_greedy(target, p, n) for p, n in zip(PROMPTS[1:], MAX_TOKENS[1:], strict=True)
        ]


@pytest.mark.parametrize(("mode", "with_draft"), MODES)
def test_a_prompt_that_makes_nan_logits_fails_at_its_first_token(target, draft, mode, with_draft) -> None:
    sampling, any_draft, config = _mode(mode, with_draft, draft)
    requests = _requests(PROMPTS, sampling)
    clean = _run(target, any_draft, requests, **config)
    others = {t for key in (1, 2) for t in (*PROMPTS[key], *clean[key].token_ids)}
    poison = next(t for t in PROMPTS[0] if t not in others)

    results = _run(_poisoned(target, poison), any_draft, requests, **config)

    _assert_failed_at(results[0], 1)  # the prefill's logits, which decide the first token
    assert [results[k].token_ids for k in (1, 2)] == [clean[k].token_ids for k in (1, 2)]


def test_a_row_that_failed_on_nan_is_clean_for_the_next_request(target) -> None:
    # batch 2: the third request takes the failed request's row, whose cache held NaN keys and values past
    # the new prompt; read under the mask, they made its logits NaN too (0 x NaN is NaN)
    long_prompt = [5, 9, 14, 3, 22, 17, 19, 23, 29, 31, 37, 43, 47, 53, 57, 59, 60, 62, 26, 28]
    prompts = (long_prompt, [40, 41, 7], [12, 30])
    clean = _run(target, None, _requests(prompts), batch_size=2)
    others = {t for key in (1, 2) for t in (*prompts[key], *clean[key].token_ids)}
    poison = next(t for t in long_prompt[:3] if t not in others)

    results = _run(_poisoned(target, poison), None, _requests(prompts), batch_size=2)

    _assert_failed_at(results[0], 1)
    assert [results[k].token_ids for k in (1, 2)] == [
        reference_greedy(target, p, n) for p, n in zip(prompts[1:], MAX_TOKENS[1:], strict=True)
    ]


def test_infinite_logits_fail_the_request_too(target) -> None:
    # +inf in the logits: a softmax of NaN, and an argmax that looks like an answer
    broken = copy.deepcopy(target)
    hook = broken.lm_head.register_forward_hook(
        lambda module, args, logits: logits.index_fill(-1, torch.tensor([7]), float("inf"))
    )
    try:
        results = _run(broken, None, _requests(PROMPTS, SAMPLED))
    finally:
        hook.remove()
    for key in range(3):
        _assert_failed_at(results[key], 1)


# -- the draft -------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", [None, SAMPLED], ids=["greedy", "sampled"])
def test_a_draft_whose_logits_are_all_nan_never_changes_the_output(target, draft, sampling) -> None:
    # every draft token is rejected and each output token sampled from the target at its own position,
    # with the target's own numbers: the output is exactly the target's alone
    broken_draft = copy.deepcopy(draft)
    with torch.no_grad():
        broken_draft.lm_head.weight.fill_(float("nan"))
    requests = _requests(PROMPTS, sampling)
    alone = _run(target, None, requests)

    results = _run(target, broken_draft, requests)

    for key in range(3):
        assert results[key].error is None
        assert results[key].token_ids == alone[key].token_ids, key
        assert results[key].accepted_tokens == 0 < results[key].draft_tokens


@pytest.mark.parametrize(
    "mode", [{}, {"sampling_params": SAMPLED, "sampling": "reproducible"}], ids=["greedy", "reproducible"]
)
def test_a_draft_with_nan_logits_on_one_token_never_changes_the_output(target, draft, mode) -> None:
    # the draft is fine until a row feeds it the poisoned token, then NaN for that row alone
    sampling, _, config = _mode(mode, False, draft)
    requests = _requests(PROMPTS, sampling)
    alone = _run(target, None, requests, **config)
    poison, _ = _poison_in_output(alone, 0, PROMPTS)

    results = _run(target, _poisoned(draft, poison), requests, **config)

    assert [results[k].token_ids for k in range(3)] == [alone[k].token_ids for k in range(3)]
    assert all(results[k].error is None for k in range(3))


def test_nan_draft_probabilities_are_rejected_and_leave_the_target_distribution() -> None:
    from specq.decoding.rejection import rejection_sample

    # row 0: draft position 1 is NaN, position 0 accepted (the target's 1.0 on the draft token); row 1:
    # every draft position is NaN; row 2: position 0 is NaN but for the draft token's own entry, which
    # an acceptance test would read as 0.5. Each row samples its first NaN position from the target alone.
    vocab = 4
    draft_token_ids = torch.tensor([[2, 3], [2, 3], [2, 3]])
    draft_probs = torch.full((3, 2, vocab), 0.25)
    draft_probs[0, 1] = draft_probs[1] = float("nan")
    draft_probs[2, 0] = torch.tensor([float("nan"), 0.0, 0.5, 0.0])
    target_probs = torch.zeros(3, 3, vocab)
    target_probs[:2, 0, 2] = 1.0
    target_probs[2, 0] = torch.tensor([0.5, 0.0, 0.5, 0.0])  # its inverse CDF at 0.25: token 0
    target_probs[:, 1, 1] = 1.0  # the one token the target allows at position 1
    target_probs[:, 2, 0] = 1.0
    output, accepted = rejection_sample(
        draft_token_ids,
        draft_probs,
        target_probs,
        torch.full((3, 2), 0.5),
        torch.full((3, 3), 0.25),
        torch.tensor([2, 2, 2]),
    )
    assert accepted.tolist() == [1, 0, 0]
    assert [output[0, :2].tolist(), output[1, 0].item(), output[2, 0].item()] == [[2, 1], 2, 0]


# -- the CLI ---------------------------------------------------------------------------------------
def test_run_fails_the_request_with_nan_logits_with_exit_1_and_the_error_in_its_line(tiny_pair, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir = tiny_pair[0]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    lines = [
        {"id": "poisoned", "prompt": "class Point:", "max_tokens": 8, "temperature": 0},
        {"id": "plain", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0},
        {"id": "sampled", "prompt": "for i in range(10):", "max_tokens": 8, "temperature": 0.8, "seed": 3},
    ]
    path = write_requests(tmp_path / "in.jsonl", lines)
    clean_out = tmp_path / "clean.jsonl"
    ran = invoke(["run", path, "-o", str(clean_out), "--target", target_dir])
    assert ran.exit_code == 0, ran.output
    clean = [json.loads(line) for line in clean_out.read_text().splitlines()]
    others = {t for record in clean[1:] for t in record["tokens"]}
    others |= {t for line in lines[1:] for t in tokenizer(line["prompt"])["input_ids"]}
    poison = next(t for t in tokenizer(lines[0]["prompt"])["input_ids"] if t not in others)
    broken_dir = tmp_path / "broken"
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("nan")
    model.save_pretrained(broken_dir)
    tokenizer.save_pretrained(broken_dir)

    out = tmp_path / "out.jsonl"
    ran = invoke(["run", path, "-o", str(out), "--target", str(broken_dir)])

    assert ran.exit_code == 1, ran.output
    assert "Traceback" not in ran.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["error"] == (
        "the target model produced non-finite logits (NaN or inf) at token 1 of the completion"
    )
    assert records[0]["completion"] is None
    assert records[1:] == clean[1:]


def test_a_sample_of_nan_is_token_0_not_an_id_past_the_vocabulary() -> None:
    # a draft with a larger vocabulary than the target's samples over both: an id past the target's
    # would reach the target's embedding in the verify and fail the whole batch
    from specq.decoding.sampling import sample_from_probs

    weights = torch.tensor([[0.2, 0.3, 0.5, 0.0, 0.0], [float("nan")] * 5])
    assert sample_from_probs(weights, torch.tensor([0.5, 0.5])).tolist() == [2, 0]
