"""bf16 on a CPU (issue 50, item 2): `--dtype auto`'s choice on a CPU (native bf16 and a one-time
measurement, kept per machine), `--dtype bfloat16 --device cpu` end to end with a draft model and with a
draft head, and GGUF conversions kept per dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specq.decoding.compile_speedups import SpeedupMeasurement
from specq.decoding.draft_head import HEAD_WEIGHTS
from specq.models import catalogue, cpu_dtype, gguf
from specq.models.loading import load_model, model_dtype, resolve_dtype
from tests.services import invoke, write_requests
from tests.test_distill import _prompt_lines
from tests.test_draft_head import FAST
from tests.test_hostile_round3_gguf import written_gguf
from tests.tiny_models import tiny_llama

FASTER = SpeedupMeasurement((1.4, 1.5, 1.6, 1.5, 1.5))  # fp32 over bf16 seconds: bf16 surely faster
SLOWER = SpeedupMeasurement((0.5, 0.6, 0.55, 0.5, 0.6))
STRADDLING = SpeedupMeasurement((0.9, 1.2, 1.3, 0.95, 1.25))  # faster in the median, not surely


class Measurements:
    """An injected measurement that counts its calls."""

    def __init__(self, result: SpeedupMeasurement):
        self.result, self.calls = result, 0

    def __call__(self) -> SpeedupMeasurement:
        self.calls += 1
        return self.result


@pytest.fixture(scope="module")
def config():
    return tiny_llama(vocab=64, layers=1, hidden=32).config


# -- (a) auto's choice on a CPU ------------------------------------------------------------------------------
def test_without_native_bf16_auto_is_fp32_and_measures_nothing(config) -> None:
    measure = Measurements(FASTER)
    choice = cpu_dtype.choose(config, measure, native=lambda: False)
    assert (choice.dtype, measure.calls) == ("float32", 0)
    assert "no native bf16" in choice.why
    assert not (cpu_dtype.data_dir() / cpu_dtype.FILE_NAME).exists()


@pytest.mark.parametrize(
    ("measured", "dtype"), [(FASTER, "bfloat16"), (SLOWER, "float32"), (STRADDLING, "float32")], ids=str
)
def test_with_native_bf16_auto_follows_one_measurement_kept_for_later_calls(config, measured, dtype) -> None:
    first, second = Measurements(measured), Measurements(SLOWER if dtype == "bfloat16" else FASTER)
    chosen = cpu_dtype.choose(config, first, native=lambda: True)
    assert (chosen.dtype, chosen.measured, first.calls) == (dtype, True, 1)
    again = cpu_dtype.choose(config, second, native=lambda: True)  # kept: the other answer is never measured
    assert (again.dtype, again.measured, second.calls) == (dtype, False, 0)
    kept = json.loads((cpu_dtype.data_dir() / cpu_dtype.FILE_NAME).read_text())
    assert [entry["dtype"] for entry in kept.values()] == [dtype]


def test_a_model_of_another_shape_is_measured_afresh(config) -> None:
    cpu_dtype.choose(config, Measurements(FASTER), native=lambda: True)
    other = tiny_llama(vocab=64, layers=2, hidden=32).config
    measure = Measurements(SLOWER)
    assert cpu_dtype.choose(other, measure, native=lambda: True).dtype == "float32" and measure.calls == 1


def test_this_machines_flags_decide_without_measuring(config, monkeypatch) -> None:
    """The CPU's own flags (here an AVX2 EPYC: fp32): no measurement is made where they name no native bf16."""
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not cpu_dtype.has_native_bf16()
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert cpu_dtype.has_native_bf16()
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    assert cpu_dtype.has_native_bf16()


def test_auto_loads_measure_once_per_machine_and_follow_it(tiny_pair, monkeypatch) -> None:
    """Through load_model, with native bf16 claimed: the real measurement of the tiny target runs once,
    its choice is kept and the model loads in it; a second load reads the record."""
    target, _ = tiny_pair
    monkeypatch.setattr(cpu_dtype, "has_native_bf16", lambda: True)
    measured = []
    real = cpu_dtype.measure_bf16_speedup

    def counted(model):
        measured.append(1)
        return real(model)

    monkeypatch.setattr(cpu_dtype, "measure_bf16_speedup", counted)
    first = load_model(target, "cpu", "auto")
    kept = json.loads((cpu_dtype.data_dir() / cpu_dtype.FILE_NAME).read_text())
    [entry] = kept.values()
    assert str(next(first.parameters()).dtype) == f"torch.{entry['dtype']}"
    second = load_model(target, "cpu", None)
    assert next(second.parameters()).dtype == next(first.parameters()).dtype and len(measured) == 1


def test_auto_on_cuda_stays_bf16_and_an_explicit_dtype_is_taken_as_given(config) -> None:
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16 == resolve_dtype(None, "cuda")
    assert model_dtype("any", config, "cpu", "bf16") == torch.bfloat16
    assert model_dtype("any", config, "cpu", "float32") == torch.float32


# -- (b) bf16 end to end on a CPU --------------------------------------------------------------------------
def _run_bf16(target: str, draft: str | None, tmp_path: Path, name: str) -> list[dict]:
    lines = [{"id": str(i), "prompt": prompt, "temperature": 0} for i, prompt in enumerate(PROMPTS)]
    requests = write_requests(tmp_path / "in.jsonl", lines)
    out = tmp_path / f"{name}.jsonl"
    draft_args = [] if draft is None else ["--draft", str(draft)]
    argv = ["run", requests, "-o", str(out), "--target", target, "--max-tokens", "24", *draft_args]
    ran = invoke([*argv, "--dtype", "bfloat16", "--device", "cpu", "--batch-size", "2", "--compile", "off"])
    assert ran.exit_code == 0, ran.output
    return [json.loads(line) for line in out.read_text().splitlines()]


PROMPTS = ("def mul(a, b):", "class Point:", "for i in range(10):")


def test_bf16_greedy_with_a_draft_model_is_the_bf16_targets(tiny_pair, tmp_path) -> None:
    target, draft = tiny_pair
    alone = _run_bf16(target, None, tmp_path, "alone")
    drafted = _run_bf16(target, draft, tmp_path, "drafted")
    assert [line["tokens"] for line in drafted] == [line["tokens"] for line in alone]
    assert sum(line["draft_tokens"] for line in drafted) > 0


def test_bf16_head_trains_and_decodes_the_bf16_targets_greedy_output(tiny_pair, tmp_path) -> None:
    target, _ = tiny_pair
    data = write_requests(tmp_path / "prompts.jsonl", _prompt_lines(12))
    head = tmp_path / "head"
    argv = ["draft", "train", "--target", target, "--data", data, "-o", str(head), *FAST]
    trained = invoke([*argv, "--dtype", "bfloat16", "--device", "cpu", "--compile", "off"])
    assert trained.exit_code == 0, trained.output
    weights = torch.load(head / HEAD_WEIGHTS, map_location="cpu", weights_only=True)
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}  # the target's dtype
    alone = _run_bf16(target, None, tmp_path, "alone")
    with_head = _run_bf16(target, str(head), tmp_path, "head")
    assert [line["tokens"] for line in with_head] == [line["tokens"] for line in alone]
    assert sum(line["draft_tokens"] for line in with_head) > 0


# -- (c) GGUF conversions per dtype -------------------------------------------------------------------------
@pytest.fixture
def conversions(monkeypatch) -> list[str]:
    """gguf._convert replaced by one that saves a tiny Llama in the dtype asked (the GGUF reader itself is
    test_real_models.py's); each conversion's dtype listed. The conversion around it runs as it is."""
    from transformers import PreTrainedTokenizerFast

    done: list[str] = []

    def convert(path: Path, into: Path, dtype: str) -> None:
        done.append(dtype)
        tiny_llama(vocab=64, layers=1, hidden=32).to(getattr(torch, dtype)).save_pretrained(into)
        PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), eos_token="</s>").save_pretrained(into)

    monkeypatch.setattr(gguf, "_convert", convert)
    return done


def _tokenizer():
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "a": 2}, unk_token="a"))


def test_a_bf16_load_of_a_gguf_file_converts_once_into_a_bf16_folder_of_its_own(conversions, tmp_path) -> None:
    from safetensors import safe_open

    source = written_gguf(tmp_path / "model.gguf")
    model = load_model(str(source), "cpu", "bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    folder = gguf.converted_folder(source, "bfloat16")
    assert folder.name.endswith("-bfloat16") and conversions == ["bfloat16"]  # tokenizer, config and weights
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()} == {torch.bfloat16}  # noqa: SIM118
    load_model(str(source), "cpu", "bfloat16")
    assert conversions == ["bfloat16"]  # read as saved, not converted again
    load_model(str(source), "cpu", "float32")
    assert conversions == ["bfloat16", "float32"]
    sha = gguf._sha256(str(source.resolve()), source.stat().st_size, source.stat().st_mtime_ns)
    assert set(catalogue.converted_folders(sha)) == {"bfloat16", "float32"}
    assert gguf.converted_folder(source).name == f"{sha}-r{gguf.REVISION}"  # fp32's keeps its older name


def test_status_says_the_dtype_a_job_asked(tiny_pair, tmp_path) -> None:
    target, _ = tiny_pair
    requests = write_requests(tmp_path / "in.jsonl", [{"id": "a", "prompt": PROMPTS[0], "max_tokens": 4}])
    jobs = []
    for dtype in ("bfloat16", "auto"):
        submitted = invoke(["submit", requests, "--target", target, "--dtype", dtype, "--device", "cpu"])
        assert submitted.exit_code == 0, submitted.output
        jobs.append(submitted.stdout.strip())
    shown = [json.loads(invoke(["status", job, "--json"]).stdout)["dtype"] for job in jobs]
    assert shown == ["bfloat16", "auto"]
