"""Log-probabilities: the engine's equal a plain forward's log_softmax of the target, for every emitted
token and its top alternatives, whatever the batch, the draft or the sampling."""

from __future__ import annotations

import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from tests.tiny_models import IdTokenizer, noisy_copy, tiny_llama


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return noisy_copy(target, scale=0.002)


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(11)
    lengths = [1, 4, 9, 2, 13, 6]  # ragged on purpose
    return [torch.randint(2, 64, (n,), generator=generator).tolist() for n in lengths]


def _reference(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The target's log_softmax at each completion position, from one plain forward: [n, V]."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # [T, V]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)].log_softmax(dim=-1)


@pytest.mark.parametrize("with_draft", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_logprobs_equal_a_plain_forward(target, draft, prompts, with_draft, temperature, batch_size):
    tops = [0, 3, None, 5, 20, 1]  # None: this row did not ask
    requests = [
        GenerationRequest(
            i, tuple(p), SamplingParams(max_tokens=12, temperature=temperature, top_k=8, seed=i, logprobs=top)
        )
        for i, (p, top) in enumerate(zip(prompts, tops, strict=True))
    ]
    engine = SpeculativeEngine(
        target,
        IdTokenizer(),
        draft if with_draft else None,
        DecodingConfig(num_speculative_tokens=3, batch_size=batch_size, strict=True),
    )
    results = {r.key: r for r in engine.generate(requests)}
    for i, (prompt, top) in enumerate(zip(prompts, tops, strict=True)):
        result = results[i]
        assert result.error is None
        if top is None:
            assert result.logprobs is None
            continue
        assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids) > 0
        reference = _reference(target, prompt, result.token_ids)
        for position, (token, entry) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
            assert entry["token_id"] == token
            assert entry["token"] == f"<{token}>"
            assert entry["logprob"] == pytest.approx(float(reference[position, token]), abs=1e-4)
            values, ids = reference[position].topk(top)
            assert [t for t, _ in entry["top"]] == ids.tolist(), (i, position)
            assert [v for _, v in entry["top"]] == pytest.approx(values.tolist(), abs=1e-4)
            assert entry["top_tokens"] == [f"<{t}>" for t in ids.tolist()]


def test_logprobs_cut_with_a_stop_string(target, prompts):
    """A stop string cuts the completion; the log-probabilities follow it, one per kept token."""
    plain = SpeculativeEngine(target, IdTokenizer(), None, DecodingConfig())
    full = next(iter(plain.generate([GenerationRequest(0, tuple(prompts[2]), SamplingParams(12, 0.0))])))
    stop = f"<{full.token_ids[3]}>"
    params = SamplingParams(12, 0.0, stop=(stop,), logprobs=2)
    result = next(iter(plain.generate([GenerationRequest(0, tuple(prompts[2]), params)])))
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    assert [e["token_id"] for e in result.logprobs] == result.token_ids
