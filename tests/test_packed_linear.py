"""Prepacked linears for multi-token forwards on a CPU (decoding/packed_linear.py): the same function as
nn.Linear at every width, greedy decoding unchanged, stock PyTorch inside `plain_linears()` and
torch.compile, and applied by `load_pair` to fp32 CPU models that are not compiled."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine, packed_linear
from specq.decoding.packed_linear import (
    PackedLinear,
    can_pack,
    choose_one_row_kernels,
    pack_linears,
    plain_linears,
    time_one_row,
)
from specq.models.loading import load_pair
from tests.tiny_models import IdTokenizer, noisy_copy, tiny_llama

pytestmark = pytest.mark.skipif(not can_pack("cpu", torch.float32), reason="this PyTorch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_is_the_same_function_at_every_width(rows, bias) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias).eval()
    packed = PackedLinear(linear)
    x = torch.randn(1, rows, 48)  # [batch, tokens, in]
    with torch.inference_mode():
        assert torch.allclose(packed(x), linear(x), atol=1e-5)
    assert packed.weight is linear.weight  # shared, not copied: tied embeddings stay tied


def test_a_packed_model_deep_copies_into_one_of_its_own() -> None:
    """copy.deepcopy of a packed model (the bench's looping target is one): oneDNN's packed tensor has no
    storage to copy, so the copy packs its own weight."""
    import copy

    model = tiny_llama(seed=2)
    pack_linears(model)
    clone = copy.deepcopy(model)
    x = torch.randint(0, model.config.vocab_size, (1, 4))
    with torch.no_grad():
        next(clone.parameters()).add_(1.0)  # the copy's weights are its own
        assert not torch.allclose(clone(x).logits, model(x).logits)
    layers = [m for m in clone.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.packed is not None for m in layers)


def test_the_packed_kernel_runs_for_more_than_one_row_only_and_never_inside_plain_linears(monkeypatch) -> None:
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(packed_linear.torch.ops.mkldnn, "_linear_pointwise", counted)
    packed = PackedLinear(nn.Linear(16, 8).eval())
    with torch.inference_mode():
        packed(torch.randn(1, 1, 16))
        packed(torch.randn(2, 3, 16))
        with plain_linears():
            packed(torch.randn(2, 3, 16))
    assert calls == [6]


def test_one_row_takes_the_kernel_measured_faster_for_its_shape(monkeypatch) -> None:
    """The choice is made once per weight shape, from the injected timer's verdict: the wide layers here
    read the packed copy for one row, the narrow ones their plain weight."""
    model = nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 64)).eval()
    assert pack_linears(model) == 3
    timed = []

    def packed_faster_when_wide(layer: PackedLinear) -> tuple[float, float]:
        timed.append((layer.out_features, layer.in_features))
        return (2.0, 1.0) if layer.out_features == 64 else (1.0, 2.0)

    assert choose_one_row_kernels(model, packed_faster_when_wide) == 2
    assert sorted(timed) == [(16, 64), (64, 16)]  # each shape measured once
    assert [layer.one_row_packed for layer in model] == [True, False, True]
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(packed_linear.torch.ops.mkldnn, "_linear_pointwise", counted)
    x = torch.randn(1, 1, 16)  # [batch, tokens, in]
    with torch.inference_mode():
        expected = x
        for layer in model:
            assert isinstance(layer, PackedLinear)
            expected = torch.nn.functional.linear(expected, layer.weight, layer.bias)
        assert torch.allclose(model(x), expected, atol=1e-5)
    assert calls == [1, 1]  # the two wide layers, one row each


def test_the_one_row_timer_times_both_kernels_on_the_layer() -> None:
    plain_s, packed_s = time_one_row(PackedLinear(nn.Linear(32, 48).eval()), repeats=2)
    assert 0 < plain_s < 10 and 0 < packed_s < 10


def test_greedy_decoding_with_packed_linears_is_the_plain_models() -> None:
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, scale=0.002)
    prompts = [[5, 9, 13, 2], [7, 7, 1], [3, 11, 4, 8, 6, 2]]
    params = SamplingParams(max_tokens=12, temperature=0.0)

    def decode(with_draft: bool) -> list[list[int]]:
        engine = SpeculativeEngine(target, IdTokenizer(), draft if with_draft else None, DecodingConfig(batch_size=3))
        requests = [GenerationRequest(key, tuple(ids), params) for key, ids in enumerate(prompts)]
        return [r.token_ids for r in sorted(engine.generate(requests), key=lambda r: r.key)]

    plain = decode(False)
    assert pack_linears(target) > 0 and pack_linears(draft) > 0
    assert decode(False) == plain
    assert decode(True) == plain
    for model in (target, draft):  # and with every one-row forward on the packed weight too
        choose_one_row_kernels(model, lambda layer: (2.0, 1.0))
    assert decode(False) == plain
    assert decode(True) == plain


def test_a_compiled_model_traces_plain_linears() -> None:
    model = tiny_llama(seed=1)
    x = torch.randint(0, model.config.vocab_size, (1, 5))
    with torch.inference_mode():
        expected = model(x).logits
        pack_linears(model)
        compiled = torch.compile(model, dynamic=True, backend="aot_eager")
        assert torch.allclose(compiled(x).logits, expected, atol=1e-5)


def test_load_pair_packs_an_eager_fp32_pair_on_the_cpu(tiny_pair) -> None:
    pair = load_pair(str(tiny_pair[0]), str(tiny_pair[1]), "cpu", "float32")
    for model in (pair.target, pair.draft):
        assert model is not None
        assert any(isinstance(module, PackedLinear) for module in model.modules())
    bf16 = load_pair(str(tiny_pair[0]), None, "cpu", "bfloat16")
    assert not any(isinstance(module, PackedLinear) for module in bf16.target.modules())
