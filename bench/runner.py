"""`specq bench`: every way of decoding the same prompts, side by side, and what the numbers imply.

For each batch size B, on the same prompt token ids and sampling settings:

    spec          specq with the draft, adaptive k (the default engine: k <= K picked per step);
    spec_fixed    specq with the draft, k = K every step (what the achievable limit is computed for);
    target_only   specq without a draft (plain batched decoding, k = 0);
    hf_batched    HF `generate` on the target, B prompts at a time, left-padded;
    hf_assisted   HF assisted generation at batch 1 (its only batch size), the same on every row.

Each run is warmed up first (`warmup` full passes over the prompts, on the same engine, so the
adaptive policy starts from measured step times), then timed by the wall clock around the whole pass;
tokens are completion tokens (EOS excluded, as the engine counts them).

Derived numbers, from the runs' `EngineStats` (terms as in decoding/stats.py):

    a         acceptance rate of spec_fixed (accepted / draft tokens);
    E         its mean acceptance length (tokens a row gains per step: accepted + recovered or bonus);
    t_target  one single-token target forward at B rows (`target:1@B` of target_only);
    t_draft   one draft forward at B rows (`draft@B` of spec_fixed);
    t_verify  one target forward with K + 1 tokens a row at B rows (`target:{K+1}@B` of spec_fixed);
    c         t_draft / t_target, the cost ratio;
    Leviathan bound    (1 - a^(K+1)) / ((1 - a)(K c + 1)), Leviathan et al. 2023, Theorem 3.8: the
                       speedup if verifying K + 1 tokens cost one target step (true on a GPU at small B);
    achievable limit   E t_target / (K t_draft + t_verify): the speedup these measured forward times
                       allow with no overhead at all outside the forward passes;
    efficiency         measured speedup (spec_fixed or spec tokens/s over target_only) / achievable limit.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch

from bench import hf_baselines
from decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine

logger = logging.getLogger(__name__)

SPECQ_RUNS = ("spec", "spec_fixed", "target_only")
RUNS = (*SPECQ_RUNS, "hf_batched", "hf_assisted")
REFERENCE_RUN = "target_only"  # the target's own greedy output, to which every other run is compared

# Every row of the results has these keys (None where a run was skipped or a number is undefined).
ROW_COLUMNS = (
    "batch_size",
    "rows",
    "spec_tokens_per_s",
    "spec_fixed_tokens_per_s",
    "target_only_tokens_per_s",
    "hf_batched_tokens_per_s",
    "hf_assisted_tokens_per_s",
    "spec_over_target_only",
    "spec_over_hf_batched",
    "spec_over_hf_assisted",
    "target_only_over_hf_batched",
    "acceptance_rate",
    "mean_acceptance_length",
    "spec_acceptance_rate",
    "spec_mean_acceptance_length",
    "spec_mean_k",
    "spec_k_steps",
    "t_target_step_ms",
    "t_draft_step_ms",
    "t_verify_ms",
    "cost_ratio",
    "leviathan_bound",
    "achievable_limit",
    "speedup_fixed",
    "speedup_adaptive",
    "efficiency_fixed",
    "efficiency_adaptive",
    "same_output",
    "same_output_prompts",
    "mismatches",
)


@dataclass(frozen=True)
class BenchSettings:
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    num_prompts: int = 32  # twice the largest batch: continuous batching refills, static batching waits
    max_tokens: int = 64
    num_speculative_tokens: int = 4
    temperature: float = 0.0  # greedy: outputs must then match token for token across all runs
    warmup: int = 1  # full untimed passes before each timed one
    repeats: int = 1  # timed passes; the median rate is reported
    prompt_chars: int = 256
    seed: int = 0
    hf_batched: bool = True
    hf_assisted: bool = True
    hf_assistant_tokens: int | None = None  # None: HF's own assistant defaults

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError("warmup must be >= 0 and repeats >= 1")
        if self.hf_assistant_tokens is not None and self.hf_assistant_tokens < 1:
            raise ValueError(f"hf_assistant_tokens must be >= 1, got {self.hf_assistant_tokens}")


@dataclass
class Run:
    """One timed way of decoding the prompts at one batch size."""

    name: str
    batch_size: int
    tokens: list[int] = field(default_factory=list)  # completion tokens of each timed pass
    seconds: list[float] = field(default_factory=list)  # wall clock of each timed pass
    cpu_seconds: list[float] = field(default_factory=list)  # this process's CPU time of each pass
    load_average: list[float] = field(default_factory=list)  # 1-minute load before the first, after the last
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> completion token ids
    stats: dict[str, Any] | None = None  # EngineStats.to_dict() over the timed passes (specq runs)
    k_steps: dict[int, int] | None = None  # steps that proposed k tokens (specq runs)

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(t / s for t, s in zip(self.tokens, self.seconds, strict=True) if s > 0)

    def forward_seconds(self) -> dict[str, float]:
        return self.stats["forward_seconds"] if self.stats else {}

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["outputs"] = {str(i): tokens for i, tokens in sorted(self.outputs.items())}
        out["tokens_per_second"] = self.tokens_per_second
        return out


# -- the derived numbers (pure) ---------------------------------------------------------------------
def leviathan_bound(acceptance_rate: float, cost_ratio: float, k: int) -> float:
    """Expected speedup of speculative decoding with k draft tokens (Leviathan et al. 2023, Theorem
    3.8): (1 - a^(k+1)) / ((1 - a)(k c + 1)), with its limit (k + 1) / (k c + 1) at a = 1."""
    if acceptance_rate >= 1.0:
        return (k + 1) / (k * cost_ratio + 1)
    return (1 - acceptance_rate ** (k + 1)) / ((1 - acceptance_rate) * (k * cost_ratio + 1))


def achievable_limit(
    mean_acceptance_length: float, t_target_step: float, t_draft_step: float, t_verify: float, k: int
) -> float:
    """The speedup measured forward times allow: E[tokens per step] t_target / (k t_draft + t_verify),
    i.e. tokens per second of a step made of forward passes only, over plain decoding's."""
    return mean_acceptance_length * t_target_step / (k * t_draft_step + t_verify)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is 0."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def forward_time(forward_seconds: dict[str, float], kind: str, rows: int) -> float | None:
    """Mean seconds of the forward pass `kind` (`draft`, `target:N`) at `rows` rows, from the engine's
    `forward_seconds` keys `kind@rows`; at the nearest measured row count if `rows` was never seen."""
    measured = {}
    for key, seconds in forward_seconds.items():
        name, _, at = key.rpartition("@")
        if name == kind and at.isdigit():
            measured[int(at)] = seconds
    if not measured:
        return None
    return measured[min(measured, key=lambda r: (abs(r - rows), -r))]


def mean_k(k_steps: dict[int, int] | None) -> float | None:
    """Mean draft tokens proposed per step."""
    if not k_steps or not sum(k_steps.values()):
        return None
    return sum(k * n for k, n in k_steps.items()) / sum(k_steps.values())


def compare_outputs(outputs: dict[str, dict[int, list[int]]], reference: str = REFERENCE_RUN) -> list[dict[str, Any]]:
    """Prompts on which some run's completion differs from the reference run's: one entry per
    (prompt, run) with the first differing position and the lengths."""
    mismatches = []
    expected = outputs[reference]
    for index in sorted(expected):
        want = expected[index]
        for name, run_outputs in outputs.items():
            got = run_outputs.get(index)
            if name == reference or got == want:
                continue
            got = got or []
            position = next(
                (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got))
            )
            mismatches.append(
                {
                    "prompt": index,
                    "run": name,
                    "first_difference": position,
                    "reference_tokens": len(want),
                    "run_tokens": len(got),
                }
            )
    return mismatches


def derive_row(batch_size: int, rows: int, k: int, runs: dict[str, Run], compare: bool) -> dict[str, Any]:
    """One row of the results from the runs at one batch size (`rows`: the batch the engine actually
    formed, min(B, prompts)). `compare`: check that outputs agree (greedy decoding only)."""
    rate = {name: run.tokens_per_second for name, run in runs.items()}
    spec, fixed, plain = runs["spec"], runs["spec_fixed"], runs["target_only"]
    assert spec.stats is not None and fixed.stats is not None
    t_target = forward_time(plain.forward_seconds(), "target:1", rows)
    t_draft = forward_time(fixed.forward_seconds(), "draft", rows)
    t_verify = forward_time(fixed.forward_seconds(), f"target:{k + 1}", rows)
    a, e = fixed.stats["acceptance_rate"], fixed.stats["mean_acceptance_length"]
    c = ratio(t_draft, t_target)
    bound = leviathan_bound(a, c, k) if c is not None else None
    limit = (
        achievable_limit(e, t_target, t_draft, t_verify, k)
        if t_target and t_draft and t_verify and fixed.stats["num_drafts"]
        else None
    )
    speedup_fixed = ratio(rate["spec_fixed"], rate["target_only"])
    speedup_adaptive = ratio(rate["spec"], rate["target_only"])
    mismatches = compare_outputs({name: run.outputs for name, run in runs.items()}) if compare else None
    differing = {m["prompt"] for m in mismatches or []}

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1e3

    return {
        "batch_size": batch_size,
        "rows": rows,
        **{f"{name}_tokens_per_s": rate.get(name) for name in RUNS},
        "spec_over_target_only": speedup_adaptive,
        "spec_over_hf_batched": ratio(rate["spec"], rate.get("hf_batched")),
        "spec_over_hf_assisted": ratio(rate["spec"], rate.get("hf_assisted")),
        "target_only_over_hf_batched": ratio(rate["target_only"], rate.get("hf_batched")),
        "acceptance_rate": a,
        "mean_acceptance_length": e,
        "spec_acceptance_rate": spec.stats["acceptance_rate"],
        "spec_mean_acceptance_length": spec.stats["mean_acceptance_length"],
        "spec_mean_k": mean_k(spec.k_steps),
        "spec_k_steps": {str(kk): n for kk, n in sorted((spec.k_steps or {}).items())},
        "t_target_step_ms": ms(t_target),
        "t_draft_step_ms": ms(t_draft),
        "t_verify_ms": ms(t_verify),
        "cost_ratio": c,
        "leviathan_bound": bound,
        "achievable_limit": limit,
        "speedup_fixed": speedup_fixed,
        "speedup_adaptive": speedup_adaptive,
        "efficiency_fixed": ratio(speedup_fixed, limit),
        "efficiency_adaptive": ratio(speedup_adaptive, limit),
        "same_output": None if mismatches is None else not mismatches,
        "same_output_prompts": None if mismatches is None else len(plain.outputs) - len(differing),
        "mismatches": mismatches,
    }


def check_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The performance targets the engine is held to, each with its measured value and whether it is met."""
    checks: list[dict[str, Any]] = []

    def add(name: str, want: str, value: float | None, threshold: float) -> None:
        checks.append(
            {"target": name, "want": want, "measured": value, "met": None if value is None else value >= threshold}
        )

    by_batch = {row["batch_size"]: row for row in rows}
    if 1 in by_batch:
        add("batch 1: speedup (K fixed) / achievable limit", ">= 0.90", by_batch[1]["efficiency_fixed"], 0.9)
        add("batch 1: speedup (adaptive) / achievable limit", ">= 0.90", by_batch[1]["efficiency_adaptive"], 0.9)
    if 16 in by_batch:
        add("batch 16: spec / HF assisted", ">= 5", by_batch[16]["spec_over_hf_assisted"], 5.0)
    for row in rows:
        b = row["batch_size"]
        add(f"batch {b}: spec / target-only", ">= 1", row["spec_over_target_only"], 1.0)
        add(f"batch {b}: target-only / HF batched", ">= 1", row["target_only_over_hf_batched"], 1.0)
    return checks


# -- running ----------------------------------------------------------------------------------------
def prompt_token_ids(tokenizer, count: int, prompt_chars: int) -> tuple[list[str], list[list[int]]]:
    """`count` held-out code prompts (models/demo.py) and their token ids as the engine gets them."""
    from models.demo import heldout_prompts
    from models.loading import tokenize_prompt

    texts = heldout_prompts(count, prompt_chars)
    return texts, [tokenize_prompt(tokenizer, prompt=text) for text in texts]


def machine_info(device: str, dtype: str | None) -> dict[str, Any]:
    import transformers

    return {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") and torch.cuda.is_available() else None,
        "dtype": dtype or ("bfloat16" if device.startswith("cuda") else "float32"),
        "load_average": list(os.getloadavg()),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_bench(
    target,
    draft,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    settings: BenchSettings,
    progress: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """All runs at every batch size, the derived rows and the target checks, as one JSON-able dict."""
    k = settings.num_speculative_tokens
    greedy = settings.temperature == 0
    params = [
        SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temperature, seed=settings.seed + i)
        for i in range(len(prompts))
    ]
    requests = [GenerationRequest(i, tuple(p), params[i]) for i, p in enumerate(prompts)]
    eos_token_ids = SpeculativeEngine(target, tokenizer).eos_token_ids
    pad_token_id = _pad_token_id(tokenizer, eos_token_ids)
    hf_config = hf_baselines.generation_config(settings.max_tokens, settings.temperature, pad_token_id, eos_token_ids)

    assisted: Run | None = None
    if settings.hf_assisted:
        progress("HF assisted generation (batch 1, prompts one by one)")
        assisted = _timed(
            "hf_assisted",
            1,
            settings,
            lambda: hf_baselines.assisted_generate(
                target, draft, prompts, hf_config, eos_token_ids, settings.hf_assistant_tokens
            ),
        )
        progress(_line(assisted))

    rows: list[dict[str, Any]] = []
    runs_out: list[Run] = []
    for b in settings.batch_sizes:
        runs: dict[str, Run] = {}
        for name in SPECQ_RUNS:
            config = DecodingConfig(num_speculative_tokens=k, fixed_k=name == "spec_fixed", batch_size=b)
            engine = SpeculativeEngine(target, tokenizer, None if name == "target_only" else draft, config)
            runs[name] = _run_engine(name, engine, requests, settings)
            progress(_line(runs[name]))
        if settings.hf_batched:
            runs["hf_batched"] = _timed(
                "hf_batched",
                b,
                settings,
                functools.partial(hf_baselines.batched_generate, target, prompts, b, hf_config, eos_token_ids),
            )
            progress(_line(runs["hf_batched"]))
        if assisted is not None:
            runs["hf_assisted"] = assisted
        rows.append(derive_row(b, min(b, len(prompts)), k, runs, compare=greedy))
        runs_out.extend(run for name, run in runs.items() if name != "hf_assisted")
        if greedy and not rows[-1]["same_output"]:
            logger.warning("batch %s: outputs differ: %s", b, rows[-1]["mismatches"])
    return {
        "rows": rows,
        "targets": check_targets(rows),
        "runs": [run.to_dict() for run in ([assisted] if assisted else []) + runs_out],
        "hf_assistant": hf_baselines.assistant_settings(draft, settings.hf_assistant_tokens),
        "eos_token_ids": sorted(eos_token_ids),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _pad_token_id(tokenizer, eos_token_ids: Iterable[int]) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if isinstance(pad, int) else min(eos_token_ids, default=0)


def _run_engine(
    name: str, engine: SpeculativeEngine, requests: list[GenerationRequest], settings: BenchSettings
) -> Run:
    """Warm the engine up (its adaptive policy keeps what it measured), then time `repeats` passes."""
    for _ in range(settings.warmup):
        _collect(engine.generate(requests))
    engine.reset_stats()
    k_steps = _count_k(engine)
    run = Run(name, engine.config.batch_size, load_average=[os.getloadavg()[0]])
    for _ in range(settings.repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = _collect(engine.generate(requests))
        run.seconds.append(time.perf_counter() - wall)
        run.cpu_seconds.append(time.process_time() - cpu)
        run.tokens.append(sum(len(tokens) for tokens in outputs.values()))
        run.outputs = outputs
    run.load_average.append(os.getloadavg()[0])
    run.stats = engine.stats.to_dict()
    run.k_steps = dict(sorted(k_steps.items()))
    return run


def _timed(name: str, batch_size: int, settings: BenchSettings, once: Callable[[], hf_baselines.BaselineRun]) -> Run:
    for _ in range(settings.warmup):
        once()
    run = Run(name, batch_size, load_average=[os.getloadavg()[0]])
    for _ in range(settings.repeats):
        cpu = time.process_time()
        result = once()
        run.cpu_seconds.append(time.process_time() - cpu)
        run.seconds.append(result.seconds)
        run.tokens.append(result.tokens)
        run.outputs = result.outputs
    run.load_average.append(os.getloadavg()[0])
    return run


def _collect(results) -> dict[int, list[int]]:
    outputs = {}
    for result in results:
        if result.error is not None:
            raise RuntimeError(f"request {result.key} failed: {result.error}")
        outputs[result.key] = result.token_ids
    return outputs


def _count_k(engine: SpeculativeEngine) -> Counter:
    """Count the k the engine's policy picks each step (read-only: wraps `policy.choose`)."""
    counts: Counter = Counter()
    choose = engine.policy.choose

    def counted(rows: int, limit: int) -> int:
        k = choose(rows, limit)
        counts[k] += 1
        return k

    engine.policy.choose = counted  # type: ignore[method-assign]
    return counts


def _line(run: Run) -> str:
    return (
        f"B={run.batch_size:<3} {run.name:<12} {run.tokens[-1]:>6} tokens in {statistics.median(run.seconds):7.2f}s "
        f"= {run.tokens_per_second:8.1f} tokens/s"
    )
