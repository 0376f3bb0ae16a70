"""The engine on CUDA: fp32 exactness and bf16 (the GPU default). Skipped where there is no GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from tests.tiny_models import IdTokenizer, noisy_copy, tiny_llama


def on_cuda(model: Any, dtype: torch.dtype | None = None) -> Any:
    # Any: mypy cannot follow the decorator transformers wraps `to` in
    return model.to("cuda") if dtype is None else model.to("cuda", dtype)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _prompts():
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(2, 64, (n,), generator=generator).tolist() for n in (1, 4, 9, 16, 7, 2)]


def _reference(model, prompt, max_tokens):
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        max_new_tokens=max_tokens,
        do_sample=False,
        eos_token_id=1,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    return out[: out.index(1)] if 1 in out else out


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_identity_on_cuda_fp32(k):
    target, draft = on_cuda(tiny_llama(seed=0)), on_cuda(noisy_copy(tiny_llama(seed=0), 0.002))
    engine = SpeculativeEngine(
        target, IdTokenizer(), draft, DecodingConfig(num_speculative_tokens=k, batch_size=4, fixed_k=True, strict=True)
    )
    requests = [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=32, temperature=0)) for i, p in enumerate(_prompts())
    ]
    results = {r.key: r for r in engine.generate(requests)}
    for i, prompt in enumerate(_prompts()):
        assert results[i].token_ids == _reference(target, prompt, 32)


def test_bf16_draft_equal_to_target_and_sampling():
    target = on_cuda(tiny_llama(seed=0), torch.bfloat16)
    engine = SpeculativeEngine(target, IdTokenizer(), target, DecodingConfig(num_speculative_tokens=4, fixed_k=True))
    requests = [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=24, temperature=0.8, seed=i))
        for i, p in enumerate(_prompts())
    ]
    results = list(engine.generate(requests))
    assert len(results) == len(requests) and all(r.error is None for r in results)
    assert engine.stats.acceptance_rate > 0.95  # bf16 rounding may differ between 1-token and k-token passes


def test_cuda_graphs_decode_the_eager_tokens_on_static_shapes():
    """--compile on CUDA records CUDA graphs: the engine then decodes on static shapes, every forward
    graphed (none skipped for mutating the cache), the same tokens as eager, engine after engine."""
    from torch._dynamo.utils import counters

    from specq.decoding.compiled import compile_model, warm_up_decoding
    from specq.decoding.static_shapes import is_cuda_graphed

    target, draft = on_cuda(tiny_llama(seed=0)), on_cuda(noisy_copy(tiny_llama(seed=0), 0.002))
    compiled_target, outcome = compile_model(target, "target", "on")
    compiled_draft, _ = compile_model(draft, "draft", "on")
    assert outcome.compiled and is_cuda_graphed(compiled_target) and is_cuda_graphed(compiled_draft)
    warm_up_decoding(compiled_target, compiled_draft, IdTokenizer())
    requests = [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=12 + 5 * i, temperature=0))
        for i, p in enumerate(_prompts())
    ]
    for batch_size in (4, 3, 1, 4):
        engine = SpeculativeEngine(
            compiled_target, IdTokenizer(), compiled_draft, DecodingConfig(batch_size=batch_size)
        )
        assert engine.static_shapes
        results = {r.key: r for r in engine.generate(requests)}
        for i, prompt in enumerate(_prompts()):
            assert results[i].token_ids == _reference(target, prompt, requests[i].params.max_tokens)
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_a_draft_head_drafts_for_a_cuda_graphed_target():
    """The head reads the hidden states a CUDA-graphed target's graphs return (the tap installed before
    the compile, as a load does): it drafts, the graphs skip nothing, and fp32 output is the target's."""
    from torch._dynamo.utils import counters

    from specq.budget import Budget
    from specq.decoding.compiled import compile_model
    from specq.decoding.hf_model import HiddenTap
    from specq.decoding.static_shapes import is_cuda_graphed
    from specq.distill.corpus import Prompt, decode_with_target
    from specq.distill.job_head import train_job_head

    target = on_cuda(tiny_llama(seed=0))
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    prompts = [Prompt(i, GenerationRequest(i, tuple(p), greedy)) for i, p in enumerate(_prompts() * 4)]
    sequences = decode_with_target(target, IdTokenizer(), prompts, batch_size=8, top_k=20)
    head = train_job_head(target, sequences, Budget(tokens=20_000), depth=4).head.eval()
    HiddenTap.install(target)
    compiled, outcome = compile_model(target, "target", "on")
    assert outcome.compiled and is_cuda_graphed(compiled)
    requests = [GenerationRequest(i, tuple(p), greedy) for i, p in enumerate(_prompts())]
    for batch_size in (4, 1):
        config = DecodingConfig(num_speculative_tokens=4, batch_size=batch_size, fixed_k=True)
        engine = SpeculativeEngine(compiled, IdTokenizer(), head, config)
        results = {r.key: r for r in engine.generate(requests)}
        assert engine.stats.num_draft_tokens > 0 and engine.stats.num_accepted_tokens > 0
        for i, prompt in enumerate(_prompts()):
            assert results[i].token_ids == _reference(target, prompt, 24)
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("in_job", [False, True], ids=["draft-train", "train-n"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draft_head_trains_and_drafts_on_cuda(dtype, in_job, tmp_path):
    """`draft train`'s head on CUDA, and a `--draft train:N` job's (trained in place, then stored and
    restored as the database keeps it): trained in the target's dtype (bf16 by default there) on the
    target's decoded completions, then drafting for it; in fp32 the output is the target's own greedy
    output (in bf16 a verify of k + 1 tokens may round differently from a 1-token step, so it must only
    run)."""
    target = on_cuda(tiny_llama(seed=0), dtype)
    assert_head_trains_and_drafts(target, tmp_path, exact=dtype == torch.float32, in_job=in_job)


def assert_head_trains_and_drafts(target: Any, folder: Any, exact: bool, in_job: bool = False) -> None:
    from specq.budget import Budget
    from specq.distill.corpus import Prompt, decode_with_target
    from specq.distill.head import HeadTrainer, new_head, read_chains
    from specq.distill.job_head import head_config, head_weights, restored_head, train_job_head

    for parameter in target.parameters():
        parameter.requires_grad_(False)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    prompts = [Prompt(i, GenerationRequest(i, tuple(p), greedy)) for i, p in enumerate(_prompts() * 4)]
    sequences = decode_with_target(target, IdTokenizer(), prompts, batch_size=8, top_k=20)
    if in_job:  # as a worker trains, stores and loads a job's head (worker/trained_draft.py)
        trained = train_job_head(target, sequences, Budget(tokens=20_000), depth=4)
        assert trained.report["steps"] > 0 and trained.report["loss"] == trained.report["loss"]
        head = restored_head(head_config(trained.head), head_weights(trained.head), target)
    else:
        chains, _ = read_chains(target, sequences, folder / "states.pt")
        head = new_head(target, sequences, 48, None)
        trainer = HeadTrainer(head, chains, Budget(tokens=20_000), depth=4, learning_rate=3e-3)
        trainer.run(folder)
        assert trainer.state.step > 0 and trainer.state.loss == trainer.state.loss  # trained, and not NaN
    assert next(head.parameters()).dtype == target.dtype and next(head.parameters()).device == target.device
    config = DecodingConfig(num_speculative_tokens=4, batch_size=4, fixed_k=True)
    engine = SpeculativeEngine(target, IdTokenizer(), head.eval(), config)
    requests = [GenerationRequest(i, tuple(p), greedy) for i, p in enumerate(_prompts())]
    results = {r.key: r for r in engine.generate(requests)}
    assert all(r.error is None for r in results.values()) and engine.stats.num_draft_tokens > 0
    if exact:
        for i, prompt in enumerate(_prompts()):
            assert results[i].token_ids == _reference(target, prompt, 24)
