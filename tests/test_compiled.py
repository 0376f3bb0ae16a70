"""Compiled forwards (`--compile`): the compiled path decodes exactly what eager decodes and what
transformers' generate gives; a model that cannot be compiled runs eagerly with one warning, or, with
`on`, is refused with exit 2.

The compiler's capture (dynamo, with automatic dynamic shapes, through specq's ragged cache) is what differs from
eager; the tests compile with the `aot_eager` backend, which captures the same graphs but runs them
with eager kernels, so a 2-core CI pays seconds, not minutes of C++ code generation. The inductor
backend (the default) was checked by hand and by `specq bench --compile on` (docs/benchmark-log/2026-12.md,
"Compiled forwards" and "The roofline, on every `specq bench` report")."""

from __future__ import annotations

import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding.compiled import compile_model
from specq.errors import ModelCompileError
from tests.fleet_helpers import patience
from tests.services import invoke, write_requests
from tests.tiny_models import IdTokenizer, noisy_copy, reference_greedy, tiny_llama

PROMPTS = [[5, 9, 3, 12, 7], [4, 8], [17, 3, 3, 25, 6, 9, 9, 30, 31]]


def decode(target, draft, params: SamplingParams, batch_size: int = 3) -> dict[int, list[int]]:
    requests = [GenerationRequest(i, tuple(p), params) for i, p in enumerate(PROMPTS)]
    config = DecodingConfig(num_speculative_tokens=3, batch_size=batch_size, strict=True)
    return {r.key: r.token_ids for r in SpeculativeEngine(target, IdTokenizer(), draft, config).generate(requests)}


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=64, layers=1, hidden=32, seed=3)  # capture time grows with the layers
    return target, noisy_copy(target, scale=0.05)


@pytest.fixture(scope="module")
def compiled_pair(pair, tmp_path_factory):
    target, draft = pair
    with pytest.MonkeyPatch.context() as env:  # a module fixture runs before the per-test isolation
        env.setenv("SPECQ_HOME", str(tmp_path_factory.mktemp("compile_home")))
        compiled_target, outcome = compile_model(target, "target", "on", backend="aot_eager")
        compiled_draft, _ = compile_model(draft, "draft", "on", backend="aot_eager")
    assert outcome.compiled and compiled_target is not target
    return compiled_target, compiled_draft


def test_compiled_greedy_is_eager_greedy_and_generate(pair, compiled_pair) -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    expected = {i: reference_greedy(pair[0], p, 16) for i, p in enumerate(PROMPTS)}
    target, draft = compiled_pair
    assert decode(target, None, greedy) == expected
    assert decode(target, draft, greedy) == expected


def test_compiled_sampling_draws_what_eager_draws(pair, compiled_pair) -> None:
    """Seeded sampling through the compiled forwards takes the same tokens as eager: the same
    distribution, sample for sample (the statistical tests of eager then cover it)."""
    for seed in range(2):
        params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=seed)
        assert decode(compiled_pair[0], compiled_pair[1], params) == decode(pair[0], pair[1], params)


def test_a_compiled_model_takes_the_options_its_own_forward_takes(pair, compiled_pair) -> None:
    """A compiled forward's signature is (*args, **kwargs): what the model accepts is read from the model
    itself, so a compiled target still computes a prefill's last logits alone and emits the first token there."""
    from specq.decoding.hf_model import RaggedLM, eager_forward

    assert RaggedLM(compiled_pair[0]).keeps_logits and RaggedLM(pair[0]).keeps_logits
    assert eager_forward(compiled_pair[0]).cache_kwarg == eager_forward(pair[0]).cache_kwarg
    requests = [GenerationRequest(i, tuple(p), SamplingParams(max_tokens=1)) for i, p in enumerate(PROMPTS)]
    engine = SpeculativeEngine(compiled_pair[0], IdTokenizer(), compiled_pair[1], DecodingConfig(batch_size=3))
    assert len(list(engine.generate(requests))) == len(PROMPTS)
    assert engine.stats.num_steps == 0


def test_a_load_compiles_one_graph_a_model_that_serves_every_prompt_and_cache_length(monkeypatch, tmp_path) -> None:
    """Prefills run eagerly, and the sizes every job varies (the columns attention reads, the cache's
    capacity) are dynamic from a model's first graph: a load compiles one decode graph a model, and then
    prefills of other lengths and steps at other cache lengths and capacities compile nothing more."""
    import numpy as np
    from torch._dynamo.utils import counters

    from specq.decoding.compiled import FirstForwards
    from specq.decoding.hf_model import RaggedLM

    monkeypatch.setenv("SPECQ_HOME", str(tmp_path))
    # of their own sizes: dynamo's graphs guard on the shapes of a module's weights, not on the module, so
    # the module fixture's models of one size would reuse their graphs
    target, draft = tiny_llama(vocab=64, layers=2, hidden=24, seed=5), tiny_llama(vocab=64, layers=1, hidden=16, seed=6)
    loads = [
        compile_model(target, "target", "on", backend="aot_eager", measure_at_load=False),
        compile_model(
            draft, "draft", "on", backend="aot_eager", first=FirstForwards(widths=(1,)), measure_at_load=False
        ),
    ]
    assert [outcome.graphs for _, outcome in loads] == [1, 1]
    graphs = counters["stats"]["unique_graphs"]
    with torch.inference_mode():  # as the engine decodes
        for (compiled, _), width in zip(loads, (2, 1), strict=True):
            lm = RaggedLM(compiled)
            for prompt, capacity in ((3, 10), (9, 40), (17, 23)):
                cache = lm.new_cache(rows=1, capacity=capacity)
                ids = torch.arange(1, prompt + 1).unsqueeze(0)  # [1, prompt]
                lm.prefill_rows(cache, np.arange(1), ids, np.array([prompt]), lm.vocab_size, last_logits=True)
                columns = prompt + torch.arange(width).unsqueeze(0)  # [1, width]
                lm.step(cache, ids[:, :width].contiguous(), columns, prompt + width, lm.vocab_size)
    assert counters["stats"]["unique_graphs"] == graphs


_COMPILING_STEPS = """
import json
from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding.compiled import FirstForwards, compile_model
from specq.decoding.stopwatch import graphs_compiled
from tests.test_compiled import PROMPTS
from tests.tiny_models import IdTokenizer, noisy_copy, reference_greedy, tiny_llama

target = tiny_llama(vocab=64, layers=1, hidden=32, seed=3)
draft = noisy_copy(target, scale=0.05)
# as a `--draft train:N` job's target: its load compiled target-only's 1-token steps alone
first = FirstForwards(1, widths=(1,))
compiled, _ = compile_model(target, "width-1", "on", backend="aot_eager", first=first, measure_at_load=False)
config = DecodingConfig(num_speculative_tokens=3, batch_size=1, fixed_k=True, strict=True)
engine = SpeculativeEngine(compiled, IdTokenizer(), draft, config)
observed = []
observe = engine.policy.observe_step
engine.policy.observe_step = lambda rows, k, *args, **kwargs: observed.append(k) or observe(rows, k, *args, **kwargs)
before = graphs_compiled()
(result,) = engine.generate([GenerationRequest(0, tuple(PROMPTS[0]), SamplingParams(max_tokens=12, temperature=0))])
print(json.dumps({
    "greedy": result.token_ids == reference_greedy(target, PROMPTS[0], 12),
    "compiled": graphs_compiled() - before,
    "steps": engine.stats.num_steps,
    "observed": len(observed),
}))
"""


def test_a_step_that_compiles_a_graph_teaches_the_policy_nothing(tmp_path) -> None:
    """A verify width the load did not compile is compiled by the step that first takes it: seconds of
    the compiler's, which the policy must not take for what a step of that width costs. In a process of
    its own: torch.compile keeps the graphs of every model of a process, so this one's would be made."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "SPECQ_HOME": str(tmp_path), "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILING_STEPS], capture_output=True, text=True, env=env, cwd=root, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["greedy"]
    assert seen["compiled"] >= 1  # the verify of k + 1 tokens compiled its graph in the job
    assert 1 <= seen["steps"] - seen["observed"] <= seen["compiled"]  # those steps alone went unobserved


def test_static_shapes_compile_a_jobs_graphs_once(pair, compiled_pair) -> None:
    """The static-shape path (what CUDA graphs need) decodes the same tokens compiled, and once a job
    has run, jobs of other sizes, prompts and lengths compile no graph more."""
    from torch._dynamo.utils import counters

    target, draft = compiled_pair
    prompts = [[5, 9, 3, 12, 7, 5, 9, 3], [4, 8], [17, 3, 3, 25, 6, 9, 9, 30, 31, 17, 3, 3], [7] * 20, [2, 40, 41]]

    def job(batch_size: int, max_tokens: int, first: int) -> None:
        chosen = prompts[first:] + prompts[:first]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        requests = [GenerationRequest(i, tuple(p), params) for i, p in enumerate(chosen)]
        config = DecodingConfig(batch_size=batch_size, static_shapes=True)
        got = {r.key: r.token_ids for r in SpeculativeEngine(target, IdTokenizer(), draft, config).generate(requests)}
        assert got == {i: reference_greedy(pair[0], p, max_tokens) for i, p in enumerate(chosen)}

    job(1, 16, 0)  # one row, then several (torch specialises a size of 1), as the warm-up decode does
    job(4, 16, 0)
    graphs = counters["stats"]["unique_graphs"]
    for batch_size, max_tokens, first in ((3, 9, 1), (2, 20, 2), (1, 5, 3), (4, 12, 4)):
        job(batch_size, max_tokens, first)
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_warm_up_compiles_every_graph_a_job_then_takes(compiled_pair) -> None:
    """After `warm_up_decoding`, jobs at other batch sizes, prompt lengths, sampling settings and
    proposers compile nothing more: the compile is paid at load, where it is reported."""
    from torch._dynamo.utils import counters

    from specq.decoding.compiled import warm_up_decoding

    target, draft = compiled_pair
    warm_up_decoding(target, draft, IdTokenizer())
    warm_up_decoding(target, None, IdTokenizer())
    graphs = counters["stats"]["unique_graphs"]
    prompts = [[5, 9, 3, 12, 7, 5, 9, 3], [4, 8], [17, 3, 3, 25, 6, 9, 9, 30, 31, 17, 3, 3], [7] * 20, [2, 40, 41]]
    prompts += [[11, 12, 13, 11, 12], [3] * 9]  # with these, a job refills two rows at once into a cache in use
    params = SamplingParams(max_tokens=14, logprobs=2, seed=4)  # sampled: the same forwards as greedy, and more
    requests = [GenerationRequest(i, tuple(p), params) for i, p in enumerate(prompts)]
    for with_draft, config in (
        (True, DecodingConfig(batch_size=1)),
        (True, DecodingConfig(batch_size=4)),
        (False, DecodingConfig(batch_size=5, model_free="ngram")),
        (True, DecodingConfig(batch_size=2, model_free="suffix")),
    ):
        list(SpeculativeEngine(target, IdTokenizer(), draft if with_draft else None, config).generate(requests))
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_decoder_layer_is_traced_once_whatever_the_depth(monkeypatch) -> None:
    """With SPECQ_COMPILE_REGIONS=1 the repeated decoder layer is compiled on a CPU, not the whole forward
    (decoding/compiled_regions.py): a three-layer model traces what a one-layer model of its width traces,
    and decodes what eager decodes; the whole forward (the default) traces every layer."""
    from torch._dynamo.utils import counters

    from specq.decoding.compiled_regions import RegionalForward

    def traced(model, name: str) -> tuple[int, object]:
        before = counters["stats"]["calls_captured"]
        compiled, outcome = compile_model(model, name, "on", backend="aot_eager", measure_at_load=False)
        assert outcome.compiled and outcome.graphs >= 1
        return counters["stats"]["calls_captured"] - before, compiled

    monkeypatch.setenv("SPECQ_COMPILE_REGIONS", "1")
    # each of a width no other model here has: a layer of a width compiled before reuses its graphs
    shallow, _ = traced(tiny_llama(vocab=64, layers=1, hidden=56, seed=5), "shallow")
    model = tiny_llama(vocab=64, layers=3, hidden=48, seed=5)
    deep, compiled = traced(model, "deep")
    assert isinstance(compiled, RegionalForward) and deep == shallow > 0
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    assert decode(compiled, None, greedy) == {i: reference_greedy(model, p, 10) for i, p in enumerate(PROMPTS)}

    monkeypatch.delenv("SPECQ_COMPILE_REGIONS")  # the default: the whole forward
    # after a first compile: the whole forward's sizes that varied (the widths too) are symbolic in the next
    traced(tiny_llama(vocab=64, layers=1, hidden=16, seed=5), "whole first")
    whole_shallow, _ = traced(tiny_llama(vocab=64, layers=1, hidden=24, seed=5), "whole shallow")
    whole_deep, compiled = traced(tiny_llama(vocab=64, layers=3, hidden=64, seed=5), "whole deep")
    assert not isinstance(compiled, RegionalForward) and whole_deep > whole_shallow


def test_a_load_can_leave_the_measurement_to_after_its_first_tokens(tiny_pair, monkeypatch) -> None:
    """`specq run` and the worker load without measuring the speedup (`measure_at_load=False`) and measure
    it after their tokens: once per model and machine, then kept for `auto`, which follows it."""
    from specq.decoding.compile_speedups import recorded_measurement, speedup_key
    from specq.decoding.hf_model import eager_forward
    from specq.models.loading import load_pair

    monkeypatch.setenv("SPECQ_COMPILE_BACKEND", "aot_eager")
    pair = load_pair(tiny_pair[0], tiny_pair[1], "cpu", None, "on", measure_at_load=False)
    target = eager_forward(pair.target).model
    assert pair.compiled["target"].speedup is None
    assert recorded_measurement(speedup_key(target, "aot_eager")) is None
    assert "measuring" not in (pair.compile_line() or "")
    line = pair.measure_compiled_speedups()  # the tiny draft has the target's config: measured as one
    assert line is not None and "target: a decode step" in line
    kept = recorded_measurement(speedup_key(target, "aot_eager"))
    assert kept is not None and pair.compiled["target"].speedup == pytest.approx(kept.median, abs=1e-3)  # kept rounded
    assert pair.measure_compiled_speedups() is None  # measured once
    again = load_pair(tiny_pair[0], tiny_pair[1], "cpu", None, "on", measure_at_load=False)
    assert again.compiled["target"].speedup == kept.median and again.measure_compiled_speedups() is None


def _measured(*ratios: float):
    from specq.decoding.compile_speedups import SpeedupMeasurement

    return SpeedupMeasurement(ratios)


def test_the_rule_compiles_where_three_rounds_in_four_measured_it_faster() -> None:
    """`decide` reads the rounds' lower quartile: one slow round (a busy spell) does not flip a clear
    gain, a gain inside the noise is no gain, and the threshold itself counts as faster."""
    from specq.decoding.compile_speedups import MIN_SPEEDUP, decide

    assert decide(_measured(1.4, 1.5, 1.45, 1.38, 0.4, 1.5, 1.42, 1.39, 1.41)).compile  # one busy round
    assert not decide(_measured(1.0, 1.1, 0.98, 1.12, 1.02, 1.09, 1.01, 1.08, 1.0)).compile  # inside the noise
    assert not decide(_measured(0.9, 0.92, 0.91)).compile
    assert decide(_measured(*[MIN_SPEEDUP] * 9)).compile
    assert decide(_measured(1.3)).compile  # one round: its own spread
    why = decide(_measured(1.0, 1.1, 0.98, 1.12, 1.02, 1.09, 1.01, 1.08, 1.0)).why
    assert "1.02x eager's speed (1.00-1.09 over 9 rounds)" in why and "not surely 1.05x" in why


def test_a_measurement_takes_rounds_in_turns_and_the_best_of_each_sides_calls() -> None:
    """Timings injected: each side's calls return preset seconds. The order of the sides alternates
    from round to round, and a round's ratio is eager's best over compiled's best."""
    from specq.decoding.compile_speedups import measure

    calls: list[str] = []

    def side(name: str, seconds: list[float]):
        times = iter(seconds)

        def run() -> float:
            calls.append(name)
            return next(times)

        return run

    eager = side("eager", [3.0, 2.0, 2.5, 9.0, 2.0, 4.0])  # a disturbed call: the round's best still 2.0
    compiled = side("compiled", [1.0, 1.5, 1.2, 4.0, 5.0, 4.0])
    measurement = measure((eager, compiled), rounds=2, calls=3)
    assert calls == ["eager"] * 3 + ["compiled"] * 3 + ["compiled"] * 3 + ["eager"] * 3
    assert measurement.ratios == (2.0, 0.5)
    assert measurement.spread == (0.875, 1.625) and measurement.median == 1.25


def test_auto_on_a_cpu_follows_what_a_compile_here_measured_once(pair, monkeypatch) -> None:
    """auto on a CPU follows the measurement kept for the model's config on this machine; `on` measures
    a model once, and neither re-measures it (the decision does not flip with the machine's load)."""
    import specq.decoding.compiled as compiled

    model = pair[0]
    got, outcome = compile_model(model, "m", "auto", backend="aot_eager")
    assert got is model and not outcome.compiled and "not measured on this machine yet" in outcome.reason

    measured: list[object] = []

    def measuring(*ratios: float):
        def run(model, compiled, first):
            measured.append(model)
            return _measured(*ratios)

        return run

    monkeypatch.setattr(compiled, "_measure_speedup", measuring(1.3, 1.2, 1.25))
    got, outcome = compile_model(model, "m", "on", backend="aot_eager")
    assert got is not model and outcome.compiled and outcome.speedup == 1.25 and outcome.measured_s > 0
    assert "a decode step 1.25x eager's speed (1.23-1.27 over 3 rounds)" in outcome.summary()
    got, outcome = compile_model(model, "m", "auto", backend="aot_eager")  # what `on` measured counts
    assert got is not model and outcome.compiled and "1.25x eager's speed (1.23-1.27 over 3 rounds)" in outcome.reason
    other = tiny_llama(vocab=64, layers=2, hidden=32, seed=3)  # another config: measured apart
    assert compile_model(other, "other", "auto", backend="aot_eager")[0] is other
    assert compile_model(model, "m", "auto", backend="inductor")[0] is model  # another backend too
    assert len(measured) == 1

    monkeypatch.setattr(compiled, "_measure_speedup", measuring(0.9))  # a busy machine would measure this
    assert compile_model(model, "m", "on", backend="aot_eager")[1].measured_s == 0.0  # kept: not measured again
    assert compile_model(model, "m", "auto", backend="aot_eager")[1].compiled
    assert len(measured) == 1

    got, outcome = compile_model(other, "other", "on", backend="aot_eager")  # measured slower: `on` compiles
    assert got is not other and outcome.compiled and outcome.speedup == 0.9
    got, outcome = compile_model(other, "other", "auto", backend="aot_eager")  # auto: eager, not compiled
    assert got is other and outcome.seconds == 0.0 and "0.90x eager's speed" in outcome.reason
    assert "not surely 1.05x" in outcome.reason and outcome.speedup == 0.9
    assert compile_model(model, "m", "off")[0] is model


def test_a_compile_measures_a_speedup_and_keeps_it(pair) -> None:
    from specq.decoding.compile_speedups import ROUNDS, recorded_measurement, speedup_key

    _, outcome = compile_model(pair[1], "draft", "on", backend="aot_eager")
    assert outcome.speedup is not None and 0.0 < outcome.speedup < float("inf")
    kept = recorded_measurement(speedup_key(pair[1], "aot_eager"))
    assert kept is not None and len(kept.ratios) == ROUNDS
    assert kept.median == pytest.approx(outcome.speedup, abs=1e-3)
    assert recorded_measurement(speedup_key(pair[1], "inductor")) is None


def test_a_damaged_speedup_file_is_measured_afresh(pair, caplog) -> None:
    from specq.decoding.compile_speedups import FILE_NAME, record_measurement, recorded_measurement, speedup_key
    from specq.paths import data_dir

    key = speedup_key(pair[0], "inductor")
    (data_dir() / FILE_NAME).write_text('{"cut short')
    assert recorded_measurement(key) is None and FILE_NAME in caplog.text
    (data_dir() / FILE_NAME).write_text(f'{{"{key}": {{"speedup": 1.6}}}}')  # an older protocol's record
    assert recorded_measurement(key) is None
    record_measurement(key, "/some/folder/target", _measured(1.25, 1.2))
    assert recorded_measurement(key) == _measured(1.25, 1.2)
    assert "/some/folder" not in (data_dir() / FILE_NAME).read_text()


def test_a_workers_metrics_show_what_compiling_took_and_gained() -> None:
    from specq.decoding.compiled import CompileOutcome
    from specq.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics.create()
    outcomes = {"target": CompileOutcome(True, 12.5, speedup=1.4), "draft": CompileOutcome(False, 3.0, "x", 0.9)}
    metrics.set_compiled("demo", "cpu", outcomes, 30.0)
    value = metrics.registry.get_sample_value
    assert value("specq_model_compile_seconds", {"model_name": "demo", "device": "cpu", "role": "target"}) == 12.5
    assert value("specq_model_compile_speedup", {"model_name": "demo", "device": "cpu", "role": "target"}) == 1.4
    assert value("specq_model_compile_speedup", {"model_name": "demo", "device": "cpu", "role": "draft"}) == 1.0
    assert value("specq_model_compile_seconds", {"model_name": "demo", "device": "cpu", "role": "warm_up"}) == 30.0


def _failing_backend(graph, example_inputs):
    raise RuntimeError("this backend refuses every graph")


def test_a_model_that_cannot_compile_is_refused_with_on(pair) -> None:
    with pytest.raises(ModelCompileError, match=r"^the model 'tiny' cannot be compiled: BackendCompilerFailed"):
        compile_model(pair[0], "tiny", "on", backend=_failing_backend)


def _backend_wrong_from_the_third_call(graph, example_inputs):
    """As CUDA graphs go: a first call as compiled, a second that records, then replays; here every
    replay is off."""
    calls = [0]

    def run(*args):
        calls[0] += 1
        outputs = graph(*args)
        if calls[0] < 3:
            return outputs
        return tuple(o + 1.0 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in outputs)

    return run


def test_a_compiled_forward_that_goes_wrong_on_replay_is_caught_at_load(pair) -> None:
    with pytest.raises(ModelCompileError, match="its compiled 2-token step logits differ from eager"):
        compile_model(pair[0], "tiny", "on", backend=_backend_wrong_from_the_third_call)


def test_run_with_compile_on_and_a_model_that_cannot_compile_exits_2(tiny_pair, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECQ_COMPILE_BACKEND", "no-such-backend")
    path = write_requests(tmp_path / "in.jsonl", [{"id": "a", "prompt": "def", "max_tokens": 3}])
    out = tmp_path / "out.jsonl"
    result = invoke(["run", path, "-o", str(out), "--target", tiny_pair[0], "--compile", "on"])
    assert result.exit_code == 2, result.output
    assert f"the model {tiny_pair[0]!r} cannot be compiled: " in result.stderr and "Traceback" not in result.output
    assert not out.exists()
    result = invoke(["run", path, "-o", str(out), "--target", tiny_pair[0], "--compile", "auto"])
    assert result.exit_code == 0, result.output  # auto on CPU: eager, whatever the backend


def test_a_job_carries_its_compile_setting_to_the_worker(pg_db_url, tiny_pair, tmp_path, monkeypatch) -> None:
    """submit stores --compile with the job; the worker's own --compile decides only for `auto`."""
    from specq.worker.model_cache import ModelCache
    from tests.services import job_status, services_env

    monkeypatch.setenv("SPECQ_COMPILE_BACKEND", "no-such-backend")
    assert ModelCache(compile="off").get(tiny_pair[0], None, None, "cpu", "auto").target.__class__.__name__ == (
        "LlamaForCausalLM"  # eager: not wrapped by torch.compile
    )
    with pytest.raises(ModelCompileError):
        ModelCache(compile="off").get(tiny_pair[0], None, None, "cpu", "on")
    with pytest.raises(ModelCompileError):
        ModelCache(compile="on").get(tiny_pair[0], None, None, "cpu", "auto")

    env = services_env(pg_db_url, None, tmp_path / "home", SPECQ_COMPILE_BACKEND="no-such-backend")
    path = write_requests(tmp_path / "in.jsonl", [{"id": "a", "prompt": "def", "max_tokens": 3}])
    result = invoke(["submit", path, "--target", tiny_pair[0], "--compile", "on", "--wait"], env)
    assert result.exit_code == 1, result.output  # runs in-process: the request fails with the reason
    info = job_status(env, result.stdout.strip())
    assert (info["state"], info["failed"]) == ("failed", 1)
    result = invoke(["submit", path, "--target", tiny_pair[0], "--compile", "off", "--wait"], env)
    assert result.exit_code == 0, result.output


def test_a_workers_row_keeps_what_compile_did_with_its_models(pg_db_url, redis_url, tiny_pair, tmp_path, start_worker):
    """A worker stores with its row what `--compile` did with the models it loaded (here `auto` on a CPU
    with no measurement: both eager, and why), which `specq workers` shows."""
    import json

    from specq.jobs.status import compile_summary
    from tests.services import services_env, submit_job, wait_state

    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", [{"id": "a", "prompt": "def f(x):", "max_tokens": 4}])
    start_worker(env)
    assert [w["compiled"] for w in json.loads(invoke(["workers", "--json"], env).stdout)] == [None]  # none loaded
    job_id = submit_job(env, path, "--target", tiny_pair[0], "--draft", tiny_pair[1])
    assert wait_state(env, job_id, {"completed", "failed", "cancelled"})["state"] == "completed"
    (worker,) = json.loads(invoke(["workers", "--json"], env).stdout)
    eager = {
        "compiled": False,
        "seconds": 0.0,
        "speedup": None,
        "reason": "--compile auto on cpu: not measured on this machine yet (--compile on measures it once)",
        "graphs": 0,
        "cached_graphs": 0,
    }
    assert worker["compiled"] == {
        "target": {"model": tiny_pair[0], **eager},
        "draft": {"model": tiny_pair[1], **eager},
        "warm_up_s": 0.0,
    }
    assert "target eager, draft eager" in invoke(["workers"], {**env, "COLUMNS": "200"}).stdout
    compiled = {"model": "m", "compiled": True, "seconds": 38.04, "speedup": 1.634, "reason": ""}
    report = {"target": compiled, "draft": {**eager, "model": "d"}, "warm_up_s": 55.5}
    assert compile_summary(report) == "target 1.63x in 38s, draft eager, warm-up 56s"
    assert compile_summary({**report, "warm_up_s": 0.0}) == "target 1.63x in 38s, draft eager"
    assert compile_summary(None) == "-"


def test_a_worker_whose_own_compile_on_cannot_compile_a_jobs_models_gives_the_chunk_back(
    pg_db_url, redis_url, tiny_pair, tmp_path
) -> None:
    """`worker --compile on`, a job that left compiling to the worker (`auto`), models that cannot be compiled
    there: the worker's setting is at fault, not the job's, so no request fails; the chunk goes back to
    the queue and the worker exits 4 naming the reason. A plain worker then runs the job."""
    from specq.db.session import open_database
    from tests.services import SpecqWorker, request_states, services_env, submit_job, wait_state

    env = services_env(pg_db_url, redis_url, tmp_path / "home", SPECQ_COMPILE_BACKEND="no-such-backend")
    path = write_requests(tmp_path / "in.jsonl", [{"id": "a", "prompt": "def f(x):", "max_tokens": 4}])
    job_id = submit_job(env, path, "--target", tiny_pair[0])
    compiling = SpecqWorker(env, tmp_path / "compiling.log", args=("--compile", "on"))
    assert compiling.proc.wait(patience(120)) == 4, compiling.output()
    compiling.stop()
    assert "cannot be compiled" in compiling.output().strip().splitlines()[-1]
    with open_database(pg_db_url).session() as session:
        assert request_states(session, job_id) == {"queued": 1}
    plain = SpecqWorker(env, tmp_path / "plain.log").wait_ready()
    try:
        assert wait_state(env, job_id, {"completed", "failed", "cancelled"})["state"] == "completed"
    finally:
        plain.stop()


# One process's compile with inductor (the backend whose code the on-disk caches keep): the counts of
# graphs it compiled and of those whose code came from the FX graph cache, as JSON on stdout
_COMPILE_IN_A_PROCESS = """
import json
from torch._dynamo.utils import counters
from specq.decoding.compiled import compile_model
from tests.tiny_models import tiny_llama

_, outcome = compile_model(tiny_llama(vocab=64, layers=1, hidden=32, seed=3), "tiny", "on", backend="inductor")
print(json.dumps({"graphs": outcome.graphs, "cached": outcome.cached_graphs,
                  "misses": counters["inductor"]["fxgraph_cache_miss"], "measured": outcome.measured_s > 0}))
"""


@pytest.mark.slow
def test_a_second_process_takes_the_first_ones_compiled_graphs_from_the_cache(tmp_path) -> None:
    """The first process on a machine generates its one graph's code; a second compiles the same model
    with the graph's code from the cache in specq's data directory (a folder per torch version), and
    does not measure the model again. Counted by torch's own counters, not timed."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    env.update(SPECQ_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent.parent), env.get("PYTHONPATH")]))

    def compile_in_a_process() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", _COMPILE_IN_A_PROCESS], env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = compile_in_a_process()
    # one graph, dynamic from the start, which the measurement reuses
    assert first["graphs"] == 1 and first["cached"] == 0 and first["misses"] == 1 and first["measured"]
    assert (tmp_path / "home" / "compiled" / f"torch-{torch.__version__}").is_dir()
    second = compile_in_a_process()
    assert second["graphs"] == 1 and second["cached"] == 1 and second["misses"] == 0
    assert not second["measured"]
