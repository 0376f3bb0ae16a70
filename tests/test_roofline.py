"""The roofline of `specq bench`: the weight bytes a batch-1 decode forward reads, the measured memory
bandwidth, and each model's forward time over the floor they give, on every bench report."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specq.bench.roofline import (
    BANDWIDTH_MIN_BYTES,
    forward_floor_seconds,
    measure_bandwidth,
    measure_roofline,
    weight_bytes,
)
from tests.services import invoke
from tests.tiny_models import tiny_llama

VOCAB, HIDDEN, LAYERS = 64, 64, 2


def tiny_llama_weight_count() -> int:
    """Elements (weights and buffers) a batch-1 decode forward of `tiny_llama(vocab=64, layers=2,
    hidden=64)` reads, by hand: 4 heads of 64 / 4 = 16, 2 of them for keys and values; the MLP is
    2 * hidden wide."""
    head_dim, kv_width, mlp = HIDDEN // 4, 2 * (HIDDEN // 4), 2 * HIDDEN
    attention = HIDDEN * HIDDEN + 2 * HIDDEN * kv_width + HIDDEN * HIDDEN  # q, k, v, o
    layer = attention + 3 * HIDDEN * mlp + 2 * HIDDEN  # gate, up, down; two RMS norms
    rotary = 2 * (head_dim // 2)  # inv_freq and original_inv_freq buffers
    embedding_row, final_norm, lm_head = HIDDEN, HIDDEN, VOCAB * HIDDEN
    return LAYERS * layer + rotary + embedding_row + final_norm + lm_head


def test_weight_bytes_of_a_tiny_llama_are_the_hand_count():
    model = tiny_llama(vocab=VOCAB, layers=LAYERS, hidden=HIDDEN)
    assert tiny_llama_weight_count() == 78_224
    assert weight_bytes(model) == 4 * 78_224  # float32
    assert weight_bytes(model.bfloat16()) == 2 * 78_224


def test_a_tied_output_projection_is_read_whole_and_the_embedding_one_row():
    model = tiny_llama(vocab=VOCAB, layers=LAYERS, hidden=HIDDEN)
    untied_parameters = sum(p.numel() for p in model.parameters())
    model.lm_head.weight = model.model.embed_tokens.weight  # one tensor, stored once
    assert sum(p.numel() for p in model.parameters()) == untied_parameters - VOCAB * HIDDEN
    assert weight_bytes(model) == 4 * tiny_llama_weight_count()


def test_the_measured_bandwidth_is_positive_and_finite():
    bandwidth = measure_bandwidth("cpu", 1)  # copies BANDWIDTH_MIN_BYTES, past the caches, whatever asked
    assert math.isfinite(bandwidth) and bandwidth > 0
    assert BANDWIDTH_MIN_BYTES >= 256 * 2**20
    assert forward_floor_seconds(4 * 10**9, 2e12) == pytest.approx(2e-3)


def test_a_compiled_model_has_its_compiled_forward_beside_the_eager_one():
    model = tiny_llama(vocab=VOCAB, layers=1, hidden=32)
    # as decoding/compiled.py compiles, without its checking warm-up; aot_eager captures in seconds
    compiled = torch.compile(model, dynamic=True, backend="aot_eager")
    bandwidth, roofline = measure_roofline({"target": compiled, "draft": model})
    target, draft = roofline["models"]
    assert bandwidth > 0 and roofline["context_tokens"] == 64
    assert target["model"] == "target" and target["weight_bytes"] == weight_bytes(model)
    assert target["floor_ms"] == pytest.approx(1e3 * target["weight_bytes"] / bandwidth)
    assert target["compiled_forward_ms"] > 0 and target["compiled_over_floor"] > 0
    assert target["eager_over_floor"] == pytest.approx(target["eager_forward_ms"] / target["floor_ms"])
    assert draft["compiled_forward_ms"] is None and draft["compiled_over_floor"] is None
    assert draft["eager_over_floor"] > 0


def _check_roofline(results: dict) -> None:
    assert results["machine"]["memory_bandwidth_gb_s"] > 0
    rows = results["roofline"]["models"]
    assert [row["model"] for row in rows] == ["target", "draft"]
    for row in rows:
        assert row["weight_bytes"] > 0 and row["floor_ms"] > 0
        assert row["eager_over_floor"] > 0 and math.isfinite(row["eager_over_floor"])
        assert row["compiled_over_floor"] is None  # --compile off
        # a verify of K = 4 draft tokens is 5 wide: each width's forward, width 1 the plain step
        widths = row["eager_forward_ms_by_width"]
        assert list(widths) == ["1", "2", "3", "4", "5"] and all(ms > 0 for ms in widths.values())
        assert widths["1"] == row["eager_forward_ms"]


def _bench_args(tiny_pair, out, markdown) -> list[str]:
    target, draft = tiny_pair
    args = ["bench", "--target", target, "--draft", draft, "--batch-sizes", "1", "--num-prompts", "1"]
    args += ["--max-tokens", "4", "--prompt-chars", "64", "--warmup", "0", "--device", "cpu"]
    return [*args, "--json", str(out), "--markdown", str(markdown)]


def test_the_bench_report_has_the_roofline(tiny_pair, tmp_path):
    out, markdown = tmp_path / "bench.json", tmp_path / "bench.md"
    result = invoke([*_bench_args(tiny_pair, out, markdown), "--skip-hf-batched", "--skip-hf-assisted"])
    assert result.exit_code == 0, result.output
    _check_roofline(json.loads(out.read_text()))
    # the results on stdout (`specq bench > results.txt` keeps them), the progress on stderr
    assert "Roofline" in result.stdout and "eager / floor" in result.stdout and "eager ms by width" in result.stdout
    assert "roofline: memory bandwidth" in result.stderr and "Roofline" not in result.stderr
    assert "| model | weight MB | floor ms | eager forward ms | eager / floor |" in markdown.read_text()


def test_the_draft_axis_report_has_the_roofline(tiny_pair, tmp_path):
    out, markdown = tmp_path / "axis.json", tmp_path / "axis.md"
    result = invoke([*_bench_args(tiny_pair, out, markdown), "--workloads", "continuation", "--drafts", "draft"])
    assert result.exit_code == 0, result.output
    _check_roofline(json.loads(out.read_text()))
    assert "eager / floor" in result.stdout and "eager / floor" in markdown.read_text()
    assert "eager / floor" not in result.stderr


@pytest.mark.parametrize("axis", [[], ["--workloads", "continuation", "--drafts", "draft"]], ids=["pair", "draft-axis"])
def test_bench_json_on_stdout_leaves_the_tables_to_stderr(tiny_pair, tmp_path, axis):
    """`--json -`: stdout is the JSON document alone, so the tables for people go to stderr."""
    args = _bench_args(tiny_pair, tmp_path / "unused.json", tmp_path / "bench.md")
    args = [*args[: args.index("--json")], "--json", "-", "--skip-hf-batched", "--skip-hf-assisted", *axis]
    result = invoke(args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["roofline"]["models"]
    assert "eager / floor" in result.stderr


def test_the_bench_report_has_each_models_compile_seconds_beside_its_speedups(tiny_pair, tmp_path, monkeypatch):
    """`specq bench --compile on`: the roofline rows carry what compiling each model cost at load and the
    decode-step speedup it measured; the JSON keeps the whole compile report."""
    monkeypatch.setenv("SPECQ_COMPILE_BACKEND", "aot_eager")  # captures in seconds, no code generation
    out, markdown = tmp_path / "bench.json", tmp_path / "bench.md"
    args = [*_bench_args(tiny_pair, out, markdown), "--skip-hf-batched", "--skip-hf-assisted", "--compile", "on"]
    result = invoke(args)
    assert result.exit_code == 0, result.output
    results = json.loads(out.read_text())
    for row in results["roofline"]["models"]:
        assert row["compile_s"] > 0 and row["compile_speedup"] > 0 and row["compiled_forward_ms"] > 0
    # graphs compiled at load: none where this process compiled a model of the same shapes before (the
    # one dynamic decode graph serves it), so only their count's presence is this test's
    assert results["compile"]["target"]["compiled"] and isinstance(results["compile"]["target"]["graphs"], int)
    assert "--compile: target: compiled" in result.stderr
    assert "| compile s | compiled step speedup |" in markdown.read_text()


@pytest.mark.parametrize("axis", [[], ["--workloads", "continuation", "--drafts", "draft"]], ids=["pair", "draft-axis"])
def test_bench_with_compile_on_and_a_model_that_cannot_compile_exits_2(tiny_pair, tmp_path, monkeypatch, axis):
    monkeypatch.setenv("SPECQ_COMPILE_BACKEND", "no-such-backend")
    out, markdown = tmp_path / "bench.json", tmp_path / "bench.md"
    args = [*_bench_args(tiny_pair, out, markdown), "--skip-hf-batched", "--skip-hf-assisted", "--compile", "on"]
    result = invoke([*args, *axis])
    assert result.exit_code == 2, result.output
    assert "cannot be compiled: " in result.stderr and "Traceback" not in result.output
    assert not out.exists()
