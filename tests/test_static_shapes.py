"""The static-shape decode path (decoding/static_shapes.py): the same tokens as the ragged path, on a few
shapes only, with buffers that keep their addresses between engines. Its case is CUDA graphs
(tests/test_gpu.py); here it runs eagerly and compiled on the CPU."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding.kv_cache import RaggedKVCache, RaggedLayer
from specq.decoding.static_shapes import capacity_bucket, lease_cache, row_bucket, width_bucket
from tests.tiny_models import IdTokenizer, reference_greedy


def _prompts(seed: int, count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (count,), generator=generator).tolist()  # ragged, one-token prompts too
    # a span repeated, so that prompt lookup and the suffix index propose
    return [(torch.randint(2, 64, (max(n // 2, 1),), generator=generator).tolist() * 2)[:n] for n in lengths]


def _requests(prompts, max_tokens=lambda i: 6 + 7 * (i % 4), temperature=0.0):
    return [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=max_tokens(i), temperature=temperature, seed=i))
        for i, p in enumerate(prompts)
    ]


def test_the_buckets():
    assert [row_bucket(n, 12) for n in (1, 2, 3, 5, 8, 9, 12)] == [1, 2, 4, 8, 8, 12, 12]
    assert row_bucket(20, 16) == 20  # never fewer rows than requests
    assert [capacity_bucket(n) for n in (1, 128, 129, 700)] == [128, 128, 256, 1024]
    assert [width_bucket(n) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("model_free", [None, "ngram", "suffix"])
@pytest.mark.parametrize("with_draft", [True, False])
@pytest.mark.parametrize("batch_size", [1, 3, 5])
def test_greedy_on_static_shapes_equals_the_targets_greedy(target, draft, model_free, with_draft, batch_size):
    prompts = _prompts(batch_size, 11)
    config = DecodingConfig(batch_size=batch_size, model_free=model_free, static_shapes=True, strict=True)
    engine = SpeculativeEngine(target, IdTokenizer(), draft if with_draft else None, config)
    requests = _requests(prompts)
    results = {r.key: r for r in engine.generate(requests)}
    for i, prompt in enumerate(prompts):
        assert results[i].token_ids == reference_greedy(target, prompt, requests[i].params.max_tokens), f"prompt {i}"
    # the same engine again, on fewer rows than its last batch held
    again = {r.key: r for r in engine.generate(requests[:2])}
    assert [again[i].token_ids for i in range(2)] == [results[i].token_ids for i in range(2)]
    if with_draft or model_free:
        assert engine.stats.num_draft_tokens > 0


def test_sampled_rows_decode_the_same_tokens_on_either_path(target, draft):
    # reproducible sampling (the default) makes a seeded row's tokens independent of the batch around it
    prompts = _prompts(9, 10)
    tokens = []
    for static in (False, True):
        config = DecodingConfig(batch_size=4, model_free="suffix", static_shapes=static)
        engine = SpeculativeEngine(target, IdTokenizer(), draft, config)
        results = engine.generate(_requests(prompts, temperature=0.9))
        tokens.append({r.key: r.token_ids for r in results})
    assert tokens[0] == tokens[1]


class _ShapeLog:
    """Wraps a model: the (rows, tokens, key columns) of every forward, and which module ran it."""

    def __init__(self, model) -> None:
        self.model, self.prefills = model, 0
        self.shapes: Counter[tuple[int, int, int]] = Counter()
        self._orig_mod = _Prefills(self)  # as a compiled model exposes its own module

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, input_ids, attention_mask, **kwargs):
        self.shapes[(*input_ids.shape, attention_mask.shape[-1])] += 1
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


class _Prefills:
    def __init__(self, log: _ShapeLog) -> None:
        self.log = log

    def __getattr__(self, name):
        return getattr(self.log.model, name)

    def __call__(self, **kwargs):
        self.log.prefills += 1
        return self.log.model(**kwargs)


def test_a_job_takes_few_shapes_and_prefills_eagerly(target, draft):
    logs = _ShapeLog(target), _ShapeLog(draft)
    config = DecodingConfig(batch_size=6, num_speculative_tokens=4, static_shapes=True)
    engine = SpeculativeEngine(logs[0], IdTokenizer(), logs[1], config)
    for seed in (1, 2, 3):  # jobs of other prompts, lengths and sizes
        prompts = _prompts(seed, 5 + 4 * seed)
        assert len(list(engine.generate(_requests(prompts, max_tokens=lambda i: 3 + 11 * (i % 3))))) == len(prompts)
    for log in logs:
        assert log.prefills > 0  # prompts of every length go through the eager module
        rows = {shape[0] for shape in log.shapes}
        columns = {shape[2] for shape in log.shapes}
        assert rows <= {1, 2, 4, 6} and columns == {128}, log.shapes
    target_widths = {shape[1] for shape in logs[0].shapes}
    assert target_widths <= set(range(1, 6)), target_widths  # k + 1
    draft_widths = {shape[1] for shape in logs[1].shapes}
    # one token, or a catch-up (as long as the tokens decoded since the draft model last ran) rounded up
    assert all(width & (width - 1) == 0 for width in draft_widths), draft_widths
    # the ragged path, for contrast: a key length per sequence length
    ragged = _ShapeLog(target)
    engine = SpeculativeEngine(ragged, IdTokenizer(), draft, DecodingConfig(batch_size=6))
    list(engine.generate(_requests(_prompts(1, 9))))
    assert len({shape[2] for shape in ragged.shapes}) > 10


def test_engines_in_turn_reuse_one_cache_and_a_held_one_is_not_shared(target, draft):
    config = DecodingConfig(batch_size=4, static_shapes=True)
    prompts = _prompts(4, 8)
    expected = {i: reference_greedy(target, p, _requests(prompts)[i].params.max_tokens) for i, p in enumerate(prompts)}

    first = SpeculativeEngine(target, IdTokenizer(), draft, config)
    assert {r.key: r.token_ids for r in first.generate(_requests(prompts))} == expected
    address = _kept_keys(target).data_ptr()
    second = SpeculativeEngine(target, IdTokenizer(), draft, config)
    assert {r.key: r.token_ids for r in second.generate(_requests(prompts))} == expected
    assert _kept_keys(target).data_ptr() == address  # graphs recorded on it replay
    # while one engine holds the kept cache (a generator not yet finished), another decodes on its own
    with lease_cache(target, target.config.num_hidden_layers) as held:
        assert _first_keys(held).data_ptr() == address
        kept = _first_keys(held).clone()
        third = SpeculativeEngine(target, IdTokenizer(), draft, config)
        assert {r.key: r.token_ids for r in third.generate(_requests(prompts))} == expected
        assert _first_keys(held).data_ptr() == address
        assert torch.equal(_first_keys(held), kept)  # untouched by the other engine
    assert _kept_keys(target).data_ptr() == address


def _kept_keys(model) -> torch.Tensor:
    with lease_cache(model, model.config.num_hidden_layers) as cache:
        return _first_keys(cache)


def _first_keys(cache: RaggedKVCache) -> torch.Tensor:
    layer = cache.layers[0]
    assert isinstance(layer, RaggedLayer) and layer.keys is not None
    return layer.keys
