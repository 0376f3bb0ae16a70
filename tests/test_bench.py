"""`specq bench`: the derived-number formulas, token counting, output comparison, and one tiny run end to end."""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace

import click
import pytest
from click.testing import CliRunner

from specq.bench.hf_baselines import completion_tokens
from specq.bench.runner import (
    ROW_COLUMNS,
    RUNS,
    Run,
    achievable_limit,
    check_targets,
    compare_outputs,
    derive_row,
    forward_time,
    leviathan_bound,
    mean_k,
    paired_ratio,
    per_token_acceptance,
)
from specq.cli.bench import bench as bench_command
from specq.cli.main import cli


# -- formulas -----------------------------------------------------------------------------------------
def test_leviathan_bound_matches_the_paper():
    # Leviathan et al. 2023, Eq. 1 / Theorem 3.8, worked by hand: a = 0.8, K = 4, c = 0.05
    expected = (1 - 0.8**5) / ((1 - 0.8) * (4 * 0.05 + 1))
    assert leviathan_bound(0.8, 0.05, 4) == pytest.approx(expected)
    assert leviathan_bound(0.8, 0.05, 4) == pytest.approx(0.67232 / 0.24)  # 2.8013


def test_leviathan_bound_edges():
    assert leviathan_bound(0.0, 0.1, 4) == pytest.approx(1 / 1.4)  # nothing accepted: pure draft overhead
    assert leviathan_bound(1.0, 0.0, 4) == pytest.approx(5.0)  # free draft, all accepted: K + 1 tokens a step
    assert leviathan_bound(1.0, 0.25, 4) == pytest.approx(2.5)
    # continuous at a = 1
    assert leviathan_bound(1 - 1e-9, 0.25, 4) == pytest.approx(leviathan_bound(1.0, 0.25, 4), rel=1e-6)


def test_achievable_limit():
    # E = 3 tokens a step, target step 10 ms, draft 1 ms, verifying 5 tokens 12 ms: 3 * 10 / (4 * 1 + 12)
    assert achievable_limit(3.0, 0.010, 0.001, 0.012, 4) == pytest.approx(30 / 16)
    # with t_verify = t_target it is the Leviathan bound at the same a (E = (1 - a^(K+1)) / (1 - a))
    a, c, k, t = 0.7, 0.1, 4, 0.02
    e = (1 - a ** (k + 1)) / (1 - a)
    assert achievable_limit(e, t, c * t, t, k) == pytest.approx(leviathan_bound(a, c, k))


def test_per_token_acceptance():
    # 10 drafts of K = 4: 6 accepted position 1, 3 of those position 2, 1 of those 3, none 4
    assert per_token_acceptance(10, [6, 3, 1, 0]) == pytest.approx(10 / (10 + 6 + 3 + 1))
    assert per_token_acceptance(5, [5, 5, 5, 5]) == 1.0
    assert per_token_acceptance(0, [0, 0]) is None
    # consistent with the mean acceptance length when every draft has K tokens: E = (1 - a^(K+1)) / (1 - a)
    a, k, drafts = 0.5, 4, 1600
    per_position = [round(drafts * a**j) for j in range(1, k + 1)]
    alpha = per_token_acceptance(drafts, per_position)
    assert alpha == pytest.approx(a, rel=0.05)
    assert 1 + sum(per_position) / drafts == pytest.approx((1 - a ** (k + 1)) / (1 - a))


def test_forward_time_exact_or_nearest_rows():
    seconds = {"draft@4": 0.001, "draft@2": 0.0008, "target:1@4": 0.01, "target:5@4": 0.03, "target:1@16": 0.05}
    assert forward_time(seconds, "draft", 4) == 0.001
    assert forward_time(seconds, "target:5", 4) == 0.03
    assert forward_time(seconds, "draft", 3) == 0.001  # tie between 2 and 4: the larger batch
    assert forward_time(seconds, "target:1", 15) == 0.05
    assert forward_time(seconds, "target:3", 4) is None
    assert forward_time({}, "draft", 1) is None


def test_mean_k():
    assert mean_k({0: 2, 4: 6}) == pytest.approx(3.0)
    assert mean_k({}) is None


# -- token counting, output comparison ----------------------------------------------------------------
def test_completion_tokens_stop_before_the_first_eos():
    assert completion_tokens([5, 6, 2, 2, 2], {2}) == [5, 6]  # EOS, then HF's padding
    assert completion_tokens([5, 6, 7], {2}) == [5, 6, 7]
    assert completion_tokens([3, 5], {2, 3}) == []


def test_compare_outputs_reports_first_difference():
    outputs = {
        "target_only": {0: [1, 2, 3], 1: [4, 5]},
        "spec": {0: [1, 2, 3], 1: [4, 5]},
        "hf_batched": {0: [1, 9, 3], 1: [4, 5, 6]},
    }
    assert compare_outputs(outputs) == [
        {"prompt": 0, "run": "hf_batched", "first_difference": 1, "reference_tokens": 3, "run_tokens": 3},
        {"prompt": 1, "run": "hf_batched", "first_difference": 2, "reference_tokens": 2, "run_tokens": 3},
    ]
    assert compare_outputs({"target_only": {0: [1]}, "spec": {0: [1]}}) == []


def _run(name, tokens, seconds, stats=None, outputs=None):
    return Run(name, 1, [tokens], [seconds], [seconds], [0.0, 0.0], outputs or {0: [1, 2]}, stats)


def _stats(a, e, drafts, mean_seconds, per_position=(0, 0, 0, 0), k_steps=None):
    return {
        "acceptance_rate": a,
        "mean_acceptance_length": e,
        "num_drafts": drafts,
        "accepted_per_position": list(per_position),
        "mean_seconds": mean_seconds,
        "k_steps": k_steps or {},
    }


def test_derive_row_combines_the_runs():
    runs = {
        "spec": _run("spec", 300, 1.0, _stats(0.7, 3.0, 10, {}, k_steps={4: 9, 0: 1})),
        "spec_fixed": _run(
            "spec_fixed", 320, 1.0, _stats(0.6, 3.4, 10, {"draft@1": 0.001, "target:5@1": 0.012}, (8, 7, 5, 4))
        ),
        "target_only": _run("target_only", 100, 1.0, _stats(0.0, 0.0, 0, {"target:1@1": 0.010})),
        "hf_batched": _run("hf_batched", 80, 1.0),
        "hf_assisted": _run("hf_assisted", 60, 1.0, outputs={0: [1, 3]}),
    }
    row = derive_row(1, 1, 4, runs, compare=True)
    assert set(row) == set(ROW_COLUMNS)
    assert row["spec_over_target_only"] == pytest.approx(3.0)
    assert row["spec_over_hf_assisted"] == pytest.approx(5.0)
    assert row["target_only_over_hf_batched"] == pytest.approx(1.25)
    assert row["cost_ratio"] == pytest.approx(0.1)
    assert row["alpha"] == pytest.approx(24 / (10 + 8 + 7 + 5))
    assert row["leviathan_bound"] == pytest.approx(leviathan_bound(24 / 30, 0.1, 4))
    assert row["achievable_limit"] == pytest.approx(3.4 * 0.010 / (4 * 0.001 + 0.012))
    assert row["efficiency_fixed"] == pytest.approx(3.2 / row["achievable_limit"])
    assert row["t_step_fixed_ms"] is None and row["step_overhead_ms"] is None  # no step:4@1 recorded
    assert row["spec_mean_k"] == pytest.approx(3.6)
    assert row["same_output"] is False and row["same_output_prompts"] == 0
    assert row["mismatches"][0]["run"] == "hf_assisted"
    checks = {c["target"]: c["met"] for c in check_targets([row])}
    assert checks["batch 1: spec / target-only"] is True
    assert checks["batch 1: speedup (K fixed) / achievable limit"] is (row["efficiency_fixed"] >= 0.9)


def test_ratios_pair_the_passes_of_a_round():
    # b is 10 % slower in every round, but the machine slowed down at different rounds for the two
    # medians: the ratio of median rates says 2.2x, the paired rounds 1.1x
    a = Run("target_only", 16, [100] * 3, [1.0, 1.0, 2.0])
    b = Run("hf_batched", 16, [100] * 3, [1.1, 2.2, 2.2])
    assert a.tokens_per_second / b.tokens_per_second == pytest.approx(2.2)
    assert paired_ratio(a, b) == pytest.approx(1.1)
    # passes of another round-robin (another batch size) are not paired
    other = Run("hf_assisted", 1, [100] * 3, [1.1, 2.2, 2.2])
    assert paired_ratio(a, other) == pytest.approx(2.2)
    assert paired_ratio(a, None) is None


def test_derive_row_without_hf_or_comparison():
    runs = {
        "spec": _run("spec", 100, 1.0, _stats(0.0, 0.0, 0, {}, k_steps={0: 5})),
        "spec_fixed": _run("spec_fixed", 100, 1.0, _stats(0.0, 0.0, 0, {})),
        "target_only": _run("target_only", 100, 1.0, _stats(0.0, 0.0, 0, {})),
    }
    row = derive_row(4, 4, 4, runs, compare=False)
    assert row["hf_batched_tokens_per_s"] is None and row["spec_over_hf_assisted"] is None
    assert row["achievable_limit"] is None and row["same_output"] is None


# -- end to end ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random Llama target, a noisy copy of it as the draft, and a byte-level BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from specq.models.demo import heldout_prompts

    root = tmp_path_factory.mktemp("tiny-pair")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(heldout_prompts(40, 256), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>")
    eos = tokenizer.eos_token_id

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
    )
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)  # sharpen the near-uniform random logits so greedy paths have no near-ties
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.002)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root / "target", root / "draft"


def test_bench_end_to_end(tiny_pair, tmp_path):
    assert cli.get_command(click.Context(cli), "bench") is bench_command  # importing cli.bench registered it
    target, draft = tiny_pair
    out = tmp_path / "bench.json"
    markdown = tmp_path / "bench.md"
    args = ["bench", "--target", str(target), "--draft", str(draft), "--batch-sizes", "1,2", "--num-prompts", "4"]
    args += ["--max-tokens", "8", "--prompt-chars", "64", "--warmup", "0", "--device", "cpu", "--json", str(out)]
    result = CliRunner().invoke(cli, [*args, "--markdown", str(markdown)])
    assert result.exit_code == 0, result.output
    results = json.loads(out.read_text())
    assert [row["batch_size"] for row in results["rows"]] == [1, 2]
    for row in results["rows"]:
        assert set(ROW_COLUMNS) <= set(row), set(ROW_COLUMNS) - set(row)
        for name in ("spec", "spec_fixed", "target_only", "hf_batched", "hf_assisted"):
            assert row[f"{name}_tokens_per_s"] > 0, name
        assert row["same_output"] is True, row["mismatches"]
        assert row["same_output_prompts"] == 4
        assert 0.0 < row["acceptance_rate"] <= 1.0  # the noisy copy agrees often
        assert math.isfinite(row["leviathan_bound"]) and math.isfinite(row["achievable_limit"])
    assert {"cpu", "cpu_count", "torch_threads", "torch", "transformers", "device"} <= set(results["machine"])
    assert {run["name"] for run in results["runs"]} == set(RUNS)
    assert results["targets"] and "| B |" in markdown.read_text()


def test_a_temperature_below_the_sampling_minimum_benches_as_greedy(tiny_pair, tmp_path):
    # 1e-30 is greedy (SamplingParams.greedy) on both benchmarks: every run decodes the target's greedy
    # tokens and they are compared; the bench built its requests itself and sampled at logits / 1e-30
    target, draft = tiny_pair
    common = ["bench", "--target", str(target), "--draft", str(draft), "--batch-sizes", "2", "--num-prompts", "2"]
    common += [
        "--max-tokens",
        "6",
        "--prompt-chars",
        "64",
        "--warmup",
        "0",
        "--device",
        "cpu",
        "--temperature",
        "1e-30",
    ]
    for name, extra in (("hf", ["--skip-hf-assisted"]), ("draft-axis", ["--workloads", "continuation", "-k", "3"])):
        out = tmp_path / f"{name}.json"
        result = CliRunner().invoke(cli, [*common, *extra, "--json", str(out)])
        assert result.exit_code == 0, result.output
        for row in json.loads(out.read_text())["rows"]:
            same = row["same_output"] if name == "hf" else row["same_output_all"]
            assert same is True, (name, row["mismatches"])


def test_bench_rejects_half_a_pair(tiny_pair):
    result = CliRunner().invoke(cli, ["bench", "--target", str(tiny_pair[0])], env={"SPECQ_DRAFT": None})
    assert result.exit_code == 2, result.output


def test_the_draft_axis_runs_every_contender_on_every_workload_with_identical_greedy_outputs(tiny_pair):
    from specq.bench.draft_axis import markdown, run_draft_axis
    from specq.models.loading import load_pair

    pair = load_pair(tiny_pair[0], tiny_pair[1], "cpu", None)
    results = run_draft_axis(
        pair.target,
        pair.draft,
        pair.tokenizer,
        ["continuation", "grounded", "templated"],
        ["draft", "ngram", "suffix", "hybrid"],
        [1, 2],
        num_prompts=2,
        prompt_chars=64,
        max_tokens=6,
        num_speculative_tokens=3,
        temperature=0.0,
        seed=0,
        warmup=0,
        repeats=1,
    )
    rows = results["rows"]
    assert [(r["workload"], r["batch_size"]) for r in rows] == [
        (w, b) for w in ("continuation", "grounded", "templated") for b in (1, 2)
    ]
    for row in rows:
        assert list(row["contenders"]) == ["target_only", "draft", "ngram", "suffix", "hybrid"]
        assert row["same_output_all"] is True, row["mismatches"]
    assert markdown(results).count("\n") == 2 + 5 * len(rows)


def test_a_draft_axis_row_gives_the_spread_of_its_rounds_beside_the_median():
    from specq.bench.draft_axis import _row, markdown

    def timed(name, ratios):  # three rounds of 100 tokens, at these multiples of target-only's 100 tokens/s
        return Run(name, 16, [100] * 3, [1 / r for r in ratios], [1.0] * 3, [0.0, 0.0], {0: [1]})

    row = _row(
        "continuation",
        16,
        {"target_only": timed("target_only", [1, 1, 1]), "ngram": timed("ngram", [0.9, 1.05, 0.95])},
        False,
    )
    ngram = row["contenders"]["ngram"]
    assert ngram["over_target_only"] == pytest.approx(0.95)
    assert ngram["over_target_only_range"] == pytest.approx([0.9, 1.05])
    assert row["contenders"]["target_only"]["over_target_only_range"] is None
    assert "| continuation | 16 | ngram | 95.0 | 0.95x (0.90-1.05) |" in markdown({"rows": [row]})


def test_completions_that_loop_are_counted_and_named_under_the_table():
    from specq.bench.draft_axis import _row, markdown, repeats_a_short_period

    assert repeats_a_short_period([5] * 8) and repeats_a_short_period([5, 9] * 4)
    assert repeats_a_short_period(list(range(24)) + [5, 9, 4] * 3)  # an answer that turned into a loop
    assert repeats_a_short_period(list(range(20)) + list(range(8)) * 2)  # the longest period, twice
    assert not repeats_a_short_period([5] * 7)  # too short to tell a loop from an answer
    assert not repeats_a_short_period(list(range(32))) and not repeats_a_short_period([5] * 16 + [6])
    assert not repeats_a_short_period(list(range(9)) * 4)  # a period longer than a loop's
    outputs = {0: [13] * 32, 1: [7, 13] * 16, 2: list(range(32))}
    runs = {name: Run(name, 1, [96], [1.0], [1.0], [0.0, 0.0], outputs) for name in ("target_only", "ngram")}
    row = _row("grounded", 1, runs, True)
    assert (row["target_only_repetitive"], row["prompts"]) == (2, 3)
    assert "- grounded at batch 1: 2 of 3 target-only completions end in a loop" in markdown({"rows": [row]})


def test_an_unknown_workload_or_draft_is_a_usage_error():
    for args in (["--workloads", "chat"], ["--workloads", "grounded", "--drafts", "eagle"]):
        result = CliRunner().invoke(cli, ["bench", *args])
        assert result.exit_code == 2, result.output
        assert "choose from" in result.output


def test_the_templated_workload_repeats_no_prompt_at_hundreds_of_requests():
    # a repeated prompt would let the suffix index replay an earlier answer, which no real job gets
    from specq.bench.workloads import workload_prompts

    prompts = workload_prompts("templated", 256, 256)
    assert len(set(prompts)) == 256
    with pytest.raises(ValueError, match="distinct prompts"):
        workload_prompts("templated", 100_000, 256)


def test_the_draft_axis_can_time_only_the_prompts_whose_completions_do_not_loop(tiny_pair):
    import torch

    from specq.bench.draft_axis import _without_loops, markdown, repeats_a_short_period, run_draft_axis
    from specq.bench.workloads import greedy_requests
    from specq.errors import SpecqError
    from specq.models.loading import load_pair
    from tests.tiny_models import reference_greedy

    pair = load_pair(tiny_pair[0], tiny_pair[1], "cpu", None)
    requests = greedy_requests(pair.tokenizer, "grounded", 4, 16, prompt_chars=64)
    # the tiny random target loops on some of these prompts (by transformers' own greedy decoding)
    answers = [reference_greedy(pair.target, list(r.prompt_token_ids), 16) for r in requests]
    not_looping = [r for r, answer in zip(requests, answers, strict=True) if not repeats_a_short_period(answer)]
    assert 0 < len(not_looping) < len(requests)
    assert _without_loops(pair.target, pair.tokenizer, requests, 2) == not_looping
    # a target whose logits are a constant bias favouring token 5 answers 5 over and over, whatever the prompt
    looping = copy.deepcopy(pair.target)
    vocab, hidden = looping.lm_head.weight.shape
    looping.lm_head = torch.nn.Linear(hidden, vocab, bias=True)
    with torch.no_grad():
        looping.lm_head.weight.zero_()
        looping.lm_head.bias.zero_()
        looping.lm_head.bias[5] = 1.0
    assert _without_loops(looping, pair.tokenizer, requests, 2) == []

    def axis(target, drop_loops: bool) -> dict:
        return run_draft_axis(
            target,
            pair.draft,
            pair.tokenizer,
            ["grounded"],
            ["ngram"],
            [2],
            num_prompts=4,
            prompt_chars=64,
            max_tokens=16,
            temperature=0.0,
            seed=0,
            warmup=0,
            repeats=1,
            drop_loops=drop_loops,
        )

    with pytest.raises(SpecqError, match="every prompt of workload 'grounded' loops"):
        axis(looping, True)
    dropped = len(requests) - len(not_looping)
    assert axis(pair.target, False)["rows"][0]["target_only_repetitive"] == dropped
    kept = axis(pair.target, True)
    assert kept["dropped_loops"] == {"grounded": dropped}
    row = kept["rows"][0]
    assert (row["prompts"], row["target_only_repetitive"], row["same_output_all"]) == (len(not_looping), 0, True)
    assert f"- grounded: {dropped} prompts dropped before timing (--drop-loops)" in markdown(kept)


def test_drop_loops_without_workloads_is_a_usage_error():
    result = CliRunner().invoke(cli, ["bench", "--drop-loops"])
    assert result.exit_code == 2, result.output
    assert "--workloads" in result.output


def test_the_chat_workloads_give_distinct_turns_built_on_the_standard_library():
    from specq.bench.workloads import CHAT_WORKLOADS, workload_prompts

    for name in CHAT_WORKLOADS:
        turns = workload_prompts(name, 16, 0)
        assert len(set(turns)) == 16 and turns == workload_prompts(name, 16, 0), name
    assert all("```python\ndef " in turn for turn in workload_prompts("code-edit", 16, 0))
    with pytest.raises(ValueError, match="distinct prompts"):
        workload_prompts("extract", 100_000, 0)


def test_the_draft_axis_runs_transformers_beside_specq_and_a_target_alone_skips_the_draft(tiny_pair):
    from specq.bench.draft_axis import run_draft_axis
    from specq.models.loading import load_pair

    pair = load_pair(tiny_pair[0], None, "cpu", None)
    drafts = ("ngram", "hybrid", "hf_generate", "hf_prompt_lookup")
    results = run_draft_axis(
        pair.target,
        None,
        pair.tokenizer,
        ["grounded"],
        drafts,
        [1, 2],
        num_prompts=2,
        prompt_chars=64,
        max_tokens=8,
        temperature=0.0,
        seed=0,
        warmup=0,
        repeats=1,
    )
    contenders = {row["batch_size"]: list(row["contenders"]) for row in results["rows"]}
    # no draft: no hybrid; transformers' prompt lookup decodes one prompt at a time only
    assert contenders == {
        1: ["target_only", "ngram", "hf_generate", "hf_prompt_lookup"],
        2: ["target_only", "ngram", "hf_generate"],
    }
    assert all(row["same_output_all"] for row in results["rows"]), results["rows"]
    for row in results["rows"]:  # where each pass's time went, transformers' passes too
        for name, contender in row["contenders"].items():
            assert contender["prefill_seconds"] > 0 and contender["decode_forwards"] >= 0, name


def test_the_draft_axis_runs_transformers_assisted_generation_with_the_same_draft_at_batch_1(tiny_pair):
    """The seed's comparison: transformers' assisted generation with the very draft model specq drafts
    with, one prompt at a time (its only batch size), its outputs checked against target-only's; each row
    says how many completion tokens a target forward gave."""
    from specq.bench.draft_axis import markdown, run_draft_axis
    from specq.models.loading import load_pair

    pair = load_pair(tiny_pair[0], tiny_pair[1], "cpu", None)
    results = run_draft_axis(
        pair.target,
        pair.draft,
        pair.tokenizer,
        ["grounded"],
        ("draft", "hf_assisted"),
        [1, 2],
        num_prompts=2,
        prompt_chars=64,
        max_tokens=8,
        temperature=0.0,
        seed=0,
        warmup=0,
        repeats=1,
    )
    contenders = {row["batch_size"]: list(row["contenders"]) for row in results["rows"]}
    assert contenders == {1: ["target_only", "draft", "hf_assisted"], 2: ["target_only", "draft"]}
    assert all(row["same_output_all"] for row in results["rows"]), results["rows"]
    at_1 = results["rows"][0]["contenders"]
    # target-only decodes a token a forward (and one more from each prompt's prefill); the noisy copy's
    # drafts are mostly accepted, so drafting gives more tokens a forward
    plain = at_1["target_only"]["tokens_per_target_forward"]
    assert 1.0 <= plain < at_1["draft"]["tokens_per_target_forward"]
    assert plain < at_1["hf_assisted"]["tokens_per_target_forward"]
    assert "| tokens / forward | at floor tok/s |" in markdown(results)


def test_the_hybrid_contender_runs_beside_the_draft_in_the_same_rounds_from_an_empty_index(tiny_pair):
    # `draft train`'s held-out measurement asks for it (BenchSettings.hybrid). One prompt, so nothing in
    # a pass feeds its suffix index before the row ends: an index kept from the warm-up pass would offer
    # the very completion again in the timed one
    from specq.bench.runner import BenchSettings, run_bench
    from specq.models.loading import load_pair, tokenize_prompt

    pair = load_pair(tiny_pair[0], tiny_pair[1], "cpu", None)
    prompt = tokenize_prompt(pair.tokenizer, prompt="def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
    settings = BenchSettings(
        batch_sizes=(1,), num_prompts=1, max_tokens=12, warmup=1, repeats=2, hf_batched=False, hf_assisted=False
    )
    results = run_bench(pair.target, pair.draft, pair.tokenizer, [prompt], replace(settings, hybrid=True))
    (row,) = results["rows"]
    assert {run["name"] for run in results["runs"]} == {"spec", "spec_fixed", "target_only", "spec_hybrid"}
    assert row["same_output"] is True, row["mismatches"]  # the hybrid's outputs among those compared
    assert row["hybrid_tokens_per_s"] > 0 and row["hybrid_over_target_only"] > 0
    assert 0 <= row["hybrid_acceptance_rate"] <= 1
    assert "suffix" not in row["hybrid_acceptance_by_proposer"]
    without = run_bench(pair.target, pair.draft, pair.tokenizer, [prompt], settings)["rows"][0]
    assert without["hybrid_over_target_only"] is None and without["hybrid_acceptance_by_proposer"] is None
