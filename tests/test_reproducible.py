"""Reproducible sampling (`DecodingConfig(sampling="reproducible")`, `--sampling reproducible`).

The contract's guarantee: a seeded request's tokens are exactly those that target-only decoding samples
with the same seed and settings, whatever the batch, the k schedule, the worker or the draft. Checked
token for token on tiny models (batch compositions, fixed and adaptive k, model and model-free drafts,
no draft), for the distribution with test_lossless.py's chi-square test (with its power shown on two
wrong races), and through the queue: the same seeded file through differently configured jobs and
workers, and `specq run` at different batch sizes, gives identical token ids.
"""

from __future__ import annotations

import json
from itertools import zip_longest
from pathlib import Path
from typing import Any

import pytest
import torch
from scipy.stats import expon, kstest

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding import sampling as decoding_sampling
from specq.decoding.sampling import race, race_exponentials
from tests.services import invoke, services_env, submit_job, wait_state, write_requests
from tests.test_lossless import _exact_joint, _pvalue, _sampled_joint, lossless_pair
from tests.tiny_models import IdTokenizer, RepeatLastToken, noisy_copy, reference_greedy, tiny_llama, with_proposer

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def draft(target):
    return noisy_copy(target, scale=0.02)  # agrees often enough that accepted runs and rejections both happen


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(2, 64, (n,), generator=generator).tolist() for n in (1, 4, 9, 2, 13, 6)]


def _requests(prompts, temperature, top_p, top_k, key_base=0):
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, top_p=top_p, top_k=top_k, seed=1000 + i)
        for i in range(len(prompts))
    ]
    return [GenerationRequest(key_base + i, tuple(p), params[i]) for i, p in enumerate(prompts)]


def _others(prompts):
    """Requests that share the batch and differ in everything: greedy, other temperatures, other seeds."""
    settings = [(0.0, 1.0, 0), (1.3, 1.0, 0), (0.5, 0.5, 5), (1.0, 1.0, 0)]
    return [
        GenerationRequest(
            100 + i, tuple(reversed(p)), SamplingParams(max_tokens=7 + 3 * i, temperature=t, top_p=pp, top_k=k, seed=i)
        )
        for i, (p, (t, pp, k)) in enumerate(zip(prompts, settings, strict=False))
    ]


def _decode(target, draft, requests, **config) -> tuple[dict[int, list[int]], SpeculativeEngine]:
    config.setdefault("strict", True)
    engine = SpeculativeEngine(target, IdTokenizer(), draft, DecodingConfig(sampling="reproducible", **config))
    return {r.key: r.token_ids for r in engine.generate(requests)}, engine


def _target_alone(target, requests) -> dict[int, list[int]]:
    """The reference: target-only decoding, one request at a time."""
    return {r.key: _decode(target, None, [r], batch_size=1)[0][r.key] for r in requests}


SETTINGS = [(0.7, 0.9, 0), (1.0, 1.0, 20), (0.7, 1.0, 12), (1.0, 0.8, 0)]  # (temperature, top_p, top_k)
SCHEDULES = {
    "K=1": {"num_speculative_tokens": 1, "fixed_k": True},
    "K=3": {"num_speculative_tokens": 3, "fixed_k": True},
    "adaptive": {"num_speculative_tokens": 4, "probe_interval": 2},  # probes often: k changes step to step
}


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SETTINGS)
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("company", ["alone", "batched"])
def test_speculative_equals_target_alone(target, draft, prompts, temperature, top_p, top_k, schedule, company):
    requests = _requests(prompts, temperature, top_p, top_k)
    expected = _target_alone(target, requests)
    if company == "alone":
        outputs = {r.key: _decode(target, draft, [r], batch_size=1, **SCHEDULES[schedule])[0][r.key] for r in requests}
    else:  # interleaved with requests of other settings, rows refilled as they end
        mixed = [r for pair in zip_longest(requests, _others(prompts)) for r in pair if r is not None]
        outputs, engine = _decode(target, draft, mixed, batch_size=3, **SCHEDULES[schedule])
        assert engine.stats.num_draft_tokens > 0
    for request in requests:
        assert outputs[request.key] == expected[request.key], f"request {request.key}"
    assert len({tuple(tokens) for tokens in expected.values()}) == len(requests)


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SETTINGS[:2])
def test_target_only_batched_equals_target_alone(target, prompts, temperature, top_p, top_k):
    requests = _requests(prompts, temperature, top_p, top_k)
    outputs, _ = _decode(target, None, [*_others(prompts), *requests], batch_size=4)
    expected = _target_alone(target, requests)
    assert {r.key: outputs[r.key] for r in requests} == expected


def test_any_draft_gives_the_same_tokens(target, draft, prompts):
    requests = _requests(prompts, 1.0, 0.95, 0)
    expected = _target_alone(target, requests)
    other_draft = tiny_llama(seed=3, layers=1)  # unrelated to the target: rejections nearly every step
    for proposer_draft in (draft, other_draft, target):
        outputs, _ = _decode(target, proposer_draft, requests, batch_size=4, num_speculative_tokens=3, fixed_k=True)
        assert outputs == expected
    engine = SpeculativeEngine(
        target, IdTokenizer(), draft, DecodingConfig(num_speculative_tokens=2, fixed_k=True, sampling="reproducible")
    )
    point_mass = with_proposer(engine, RepeatLastToken(2, target.config.vocab_size))  # a model-free proposer
    assert {r.key: r.token_ids for r in point_mass.generate(requests)} == expected


def test_draft_equal_to_target_accepts_everything(target, prompts):
    # the same probabilities racing with the same noise have the same winner: the coupling is exact
    _, engine = _decode(target, target, _requests(prompts, 1.0, 1.0, 0), num_speculative_tokens=4, fixed_k=True)
    assert engine.stats.acceptance_rate == 1.0


def test_greedy_rows_stay_greedy(target, draft, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    requests = [GenerationRequest(i, tuple(p), params) for i, p in enumerate(prompts)]
    mixed = [r for pair in zip(requests, _requests(prompts, 1.0, 1.0, 0, key_base=50), strict=True) for r in pair]
    outputs, _ = _decode(target, draft, mixed, batch_size=5, num_speculative_tokens=3, fixed_k=True)
    for i, prompt in enumerate(prompts):
        assert outputs[i] == reference_greedy(target, prompt, MAX_TOKENS)


def test_race_noise_is_a_function_of_seed_position_and_token():
    seeds = torch.tensor([7, 2**62 + 5, 7])
    positions = torch.tensor([[10, 11, 12], [3, 4, 5], [11, 12, 13]])
    noise = race_exponentials(seeds, positions, 50)  # [3, 3, 50]
    assert noise.dtype == torch.float32 and bool((noise > 0).all()) and bool(noise.isfinite().all())
    assert torch.equal(noise[0, 1:], noise[2, :2])  # not of the row or of the draw order
    assert torch.equal(race_exponentials(seeds[1:2], positions[1:2], 30), noise[1:2, :, :30])  # nor of the width
    assert not torch.equal(noise[0, 0], noise[1, 0]) and not torch.equal(noise[0, 0], noise[0, 1])
    many = race_exponentials(torch.arange(400) * 7919, torch.arange(20).expand(400, 20), 64)
    assert kstest(many.flatten().numpy(), expon.cdf).pvalue > 1e-3
    # independent across tokens and positions, not just marginally Exp(1)
    assert abs(float(torch.corrcoef(torch.stack([many[:, :, 0].flatten(), many[:, :, 1].flatten()]))[0, 1])) < 0.02
    assert abs(float(torch.corrcoef(torch.stack([many[:, 0].flatten(), many[:, 1].flatten()]))[0, 1])) < 0.02


def test_race_never_picks_a_token_of_probability_zero():
    probs = torch.zeros(2000, 1, 16)
    probs[:, :, 5] = 1e-30  # tiny but positive against much larger noise
    noise = race_exponentials(torch.arange(2000), torch.zeros(2000, 1, dtype=torch.int64), 16)
    assert bool((race(probs, noise) == 5).all())


# -- the distribution: test_lossless.py's chi-square test, in reproducible mode -----------------------


@pytest.fixture(scope="module")
def lossless_models():
    return lossless_pair()


@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("with_draft", [True, False])
def test_reproducible_tokens_follow_the_target(lossless_models, temperature, with_draft):
    target, draft = lossless_models
    sampled = _sampled_joint(target, draft if with_draft else None, temperature, sampling="reproducible")
    assert _pvalue(sampled, _exact_joint(target, temperature)) > 1e-3


def _position_blind_noise(seeds, positions, vocab):
    """Wrong: the same noise at every position of a request, so its tokens are correlated."""
    return _right_noise(seeds, torch.zeros_like(positions), vocab)


def _biased_noise(seeds, positions, vocab):
    """Wrong: argmax probs / E^0.8 is the race of probs^1.25, a sharpened target."""
    return _right_noise(seeds, positions, vocab) ** 0.8


_right_noise = race_exponentials


@pytest.mark.parametrize("wrong_noise", [_position_blind_noise, _biased_noise])
def test_the_same_test_rejects_a_wrong_race(lossless_models, monkeypatch, wrong_noise):
    target, draft = lossless_models
    monkeypatch.setattr(decoding_sampling, "race_exponentials", wrong_noise)
    sampled = _sampled_joint(target, draft, 1.0, sampling="reproducible")
    assert _pvalue(sampled, _exact_joint(target, 1.0)) < 1e-6


# -- through the CLI and the queue --------------------------------------------------------------------

LINES: list[dict[str, Any]] = [
    {"id": f"r{i}", "prompt": prompt, "max_tokens": 10 + i, "temperature": t, "top_p": p, "top_k": k, "seed": 40 + i}
    for i, (prompt, t, p, k) in enumerate(
        [
            ("def add(a, b):", 1.0, 1.0, 0),
            ("class Point:", 0.7, 0.9, 0),
            ("for i in range(", 1.0, 1.0, 8),
            ("import os\n", 0.8, 0.95, 20),
            ("print(", 1.0, 0.8, 0),
        ]
    )
]


def _tokens(path: Path) -> dict[str, list[int]]:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert all(r["error"] is None for r in records), records
    return {r["id"]: r["tokens"] for r in records}


def _run(env, tiny_pair, path, out: Path, *args: str) -> dict[str, list[int]]:
    result = invoke(["run", path, "-o", str(out), "--target", tiny_pair[0], "--sampling", "reproducible", *args], env)
    assert result.exit_code == 0, result.output
    return _tokens(out)


def test_run_gives_the_same_tokens_at_any_batch_size_and_draft(tiny_pair, tmp_path):
    env = {"SPECQ_HOME": str(tmp_path / "home")}
    path = write_requests(tmp_path / "in.jsonl", LINES)
    expected = _run(env, tiny_pair, path, tmp_path / "alone.jsonl", "--batch-size", "1")  # target alone
    runs = [
        ("--draft", tiny_pair[1], "--batch-size", "1"),
        ("--draft", tiny_pair[1], "--batch-size", "3"),
        ("--draft", tiny_pair[1], "--batch-size", "5", "-k", "2", "--fixed-k"),
        ("--batch-size", "4"),
    ]
    for n, args in enumerate(runs):
        assert _run(env, tiny_pair, path, tmp_path / f"out{n}.jsonl", *args) == expected, args
    exact = invoke(
        ["run", path, "-o", str(tmp_path / "exact.jsonl"), "--target", tiny_pair[0], "--draft", tiny_pair[1]], env
    )
    assert exact.exit_code == 0, exact.output  # the other mode still runs; its tokens are not promised equal


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_bad_sampling_mode_is_a_usage_error(tiny_pair, tmp_path, command):
    path = write_requests(tmp_path / "in.jsonl", LINES[:1])
    args = [command, path, "--target", tiny_pair[0], "--sampling", "approximate"]
    if command == "run":
        args += ["-o", str(tmp_path / "out.jsonl")]
    result = invoke(args, {"SPECQ_HOME": str(tmp_path / "home")})
    assert result.exit_code == 2, result.output
    assert "--sampling" in result.output


def test_queue_jobs_on_different_workers_and_batches_give_the_same_tokens(
    pg_db_url, redis_url, tiny_pair, tmp_path, start_worker
):
    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", LINES)
    expected = _run(env, tiny_pair, path, tmp_path / "alone.jsonl", "--batch-size", "1")  # target alone, in-process
    jobs = [
        ("--draft", tiny_pair[1], "--batch-size", "4"),
        ("--batch-size", "2"),  # no draft
        ("--draft", tiny_pair[1], "--batch-size", "1", "-k", "3", "--fixed-k"),
    ]

    def run_jobs(worker_env, job_args):
        worker = start_worker(worker_env)
        for args in job_args:
            job_id = submit_job(env, path, "--target", tiny_pair[0], "--sampling", "reproducible", *args)
            assert wait_state(env, job_id, {"completed", "failed", "cancelled"})["state"] == "completed"
            out = tmp_path / f"{job_id}.jsonl"
            result = invoke(["export", job_id, "-o", str(out), "--format", "jsonl"], env)
            assert result.exit_code == 0, result.output
            assert _tokens(out) == expected, args
        assert worker.stop() == 0, worker.output()

    run_jobs(env, jobs[:2])
    # another worker, configured differently (two intra-op threads), takes the same file again
    run_jobs(services_env(pg_db_url, redis_url, tmp_path / "home2", OMP_NUM_THREADS="2"), jobs[1:])
