"""`specq bench`: every way of decoding the same prompts, side by side, and what the numbers imply.

For each batch size B, on the same prompt token ids and sampling settings:

    spec          specq with the draft, adaptive k (the default engine: k <= K picked per step);
    spec_fixed    specq with the draft, k = K every step (what the achievable limit is computed for);
    target_only   specq without a draft (plain batched decoding, k = 0);
    hf_batched    HF `generate` on the target, B prompts at a time, left-padded;
    hf_assisted   HF assisted generation at batch 1 (its only batch size), the same on every row;
    spec_hybrid   with `hybrid`: the draft beside prompt lookup and the suffix index, adaptive k, as
                  `--draft DRAFT --model-free suffix` runs it (each pass from an empty index, as
                  bench/draft_axis.py's contenders start: no real job is fed the same prompts' outputs twice).

Each run is warmed up first (`warmup` full passes over the prompts, on the same engine, so the
adaptive policy starts from measured step times), then timed by the wall clock around the whole pass,
the timed passes of all runs at one batch size taking turns; tokens are completion tokens (EOS
excluded, as the engine counts them). Each pass says a line as it begins (`progress`) and notes the
prompts it finished (`reached`, which `specq bench` says at most every half minute: specq/speaking.py).

Derived numbers. Forward times are means over every step of the timed passes, from the engine's
own sums and counts (`EngineStats.mean_seconds()`); counters are `EngineStats`' (terms as in
decoding/stats.py):

    a         acceptance rate of spec_fixed (vLLM's: accepted / draft tokens);
    alpha     its per-token acceptance rate as Leviathan et al. define it (accepted / positions reached);
    E         its mean acceptance length (tokens a row gains per step: accepted + recovered or bonus);
    t_target  one single-token target forward at B rows (`target:1@B` of target_only);
    t_draft   one draft forward at B rows (`draft@B` of spec_fixed);
    t_verify  one target forward with K + 1 tokens a row at B rows (`target:{K+1}@B` of spec_fixed);
    c         t_draft / t_target, the cost ratio;
    Leviathan bound    (1 - alpha^(K+1)) / ((1 - alpha)(K c + 1)), Leviathan et al. 2023, Theorem 3.8: the
                       speedup if verifying K + 1 tokens cost one target step (true on a GPU at small B);
    achievable limit   E t_target / (K t_draft + t_verify): the speedup these measured forward times
                       allow with no overhead at all outside the forward passes;
    efficiency         measured speedup (spec_fixed or spec tokens/s over target_only) / achievable limit;
    step overhead      a whole K-step's mean wall time (`step:K@B`) minus K t_draft + t_verify: the
                       time the engine spends outside the forward passes (accept, advance, host sync).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from typing import Any

import torch

from specq.bench import hf_baselines
from specq.bench.hf_baselines import PromptsDone
from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding.config import DRAFT_MODEL_SPECULATIVE_TOKENS
from specq.decoding.k_policy import SpeculationPolicy
from specq.decoding.stats import EngineStats, empty_by_proposer, leviathan_bound
from specq.limits import BENCH_SPECULATIVE_TOKENS
from specq.machine_records import cpu_name
from specq.speaking import Say

logger = logging.getLogger(__name__)

SPECQ_RUNS = ("spec", "spec_fixed", "target_only")
RUNS = (*SPECQ_RUNS, "hf_batched", "hf_assisted")
HYBRID_RUN = "spec_hybrid"  # BenchSettings.hybrid's
REFERENCE_RUN = "target_only"  # the target's own greedy output, to which every other run is compared


def _quiet(line: str) -> None:
    """Where nobody follows the benchmark."""


@dataclass(frozen=True)
class BenchRow:
    """One row of the results: every way of decoding at one batch size, and what derives from them
    (`derive_row`). Stored as a dict; None where a run was skipped or a number is undefined."""

    batch_size: int
    rows: int  # the batch the engine formed: min(B, prompts)
    # completion tokens per second of each run (RUNS), wall clock and per CPU-second of this process
    spec_tokens_per_s: float | None
    spec_fixed_tokens_per_s: float | None
    target_only_tokens_per_s: float | None
    hf_batched_tokens_per_s: float | None
    hf_assisted_tokens_per_s: float | None
    spec_tokens_per_cpu_s: float | None
    spec_fixed_tokens_per_cpu_s: float | None
    target_only_tokens_per_cpu_s: float | None
    hf_batched_tokens_per_cpu_s: float | None
    hf_assisted_tokens_per_cpu_s: float | None
    # paired ratios of those rates (`paired_ratio`)
    spec_over_target_only: float | None
    spec_over_hf_batched: float | None
    spec_over_hf_assisted: float | None
    target_only_over_hf_batched: float | None
    # acceptance: vLLM's (a) and Leviathan's (alpha) of the K-fixed run; the adaptive run's beside them
    acceptance_rate: float
    alpha: float | None
    mean_acceptance_length: float
    spec_acceptance_rate: float
    spec_mean_acceptance_length: float
    spec_mean_k: float | None
    spec_k_steps: dict[str, int]  # k -> the adaptive run's steps that proposed k
    # measured times and what they allow (the module's docstring)
    t_target_step_ms: float | None
    t_draft_step_ms: float | None
    t_verify_ms: float | None
    t_step_fixed_ms: float | None
    step_overhead_ms: float | None
    cost_ratio: float | None
    leviathan_bound: float | None
    achievable_limit: float | None
    speedup_fixed: float | None
    speedup_adaptive: float | None
    efficiency_fixed: float | None
    efficiency_adaptive: float | None
    # HYBRID_RUN's (None without it): its rate, its paired ratio over target_only, its acceptance, and
    # that acceptance by proposer (draft, ngram, suffix: those that proposed)
    hybrid_tokens_per_s: float | None
    hybrid_over_target_only: float | None
    hybrid_acceptance_rate: float | None
    hybrid_acceptance_by_proposer: dict[str, float] | None
    # greedy runs only: whether every run's outputs equal the reference run's
    same_output: bool | None
    same_output_prompts: int | None
    mismatches: list[dict[str, Any]] | None


ROW_COLUMNS = tuple(f.name for f in fields(BenchRow))  # every row of the results has these keys


@dataclass(frozen=True)
class BenchSettings:
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    num_prompts: int = 32  # twice the largest batch: continuous batching refills, static batching waits
    max_tokens: int = 64
    num_speculative_tokens: int = DRAFT_MODEL_SPECULATIVE_TOKENS
    temperature: float = 0.0  # greedy (`sampling.greedy`): outputs must then match token for token across all runs
    warmup: int = 1  # full untimed passes before each timed one
    repeats: int = 1  # timed passes; the median rate is reported
    prompt_chars: int = 256
    seed: int = 0
    hf_batched: bool = True
    hf_assisted: bool = True
    hf_assistant_tokens: int | None = None  # None: HF's own assistant defaults
    hybrid: bool = False  # also HYBRID_RUN: the draft beside prompt lookup and the suffix index

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        BENCH_SPECULATIVE_TOKENS.check("num_speculative_tokens", self.num_speculative_tokens)
        if self.warmup < 0 or self.repeats < 1:
            raise ValueError("warmup must be >= 0 and repeats >= 1")
        if self.hf_assistant_tokens is not None and self.hf_assistant_tokens < 1:
            raise ValueError(f"hf_assistant_tokens must be >= 1, got {self.hf_assistant_tokens}")

    @property
    def sampling(self) -> SamplingParams:
        """How every prompt is decoded (prompt i with seed `seed` + i)."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature)


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
    policy: dict[str, Any] | None = None  # what the adaptive-k policy believed at the end (specq runs)

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(t / s for t, s in zip(self.tokens, self.seconds, strict=True) if s > 0)

    @property
    def tokens_per_cpu_second(self) -> float:
        """Tokens per second of this process's CPU time. With one torch thread this is the rate on a core
        of its own, whatever else runs on the machine; with more, threads that spin-wait for a descheduled
        sibling count too, so it is no cleaner than the wall clock."""
        return statistics.median(t / s for t, s in zip(self.tokens, self.cpu_seconds, strict=True) if s > 0)

    @property
    def k_steps(self) -> dict[int, int] | None:
        """Steps that proposed k draft tokens (specq runs)."""
        return {int(k): n for k, n in self.stats["k_steps"].items()} if self.stats else None

    def forward_seconds(self) -> dict[str, float]:
        """Mean seconds of each kind of timed work over the timed passes, keyed as
        `EngineStats.mean_seconds()` (`draft@B`, `target:N@B`, `step:k@B`)."""
        return self.stats["mean_seconds"] if self.stats else {}

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["outputs"] = {str(i): tokens for i, tokens in sorted(self.outputs.items())}
        out["tokens_per_second"] = self.tokens_per_second
        out["tokens_per_cpu_second"] = self.tokens_per_cpu_second
        return out


# -- the derived numbers (pure) ---------------------------------------------------------------------
def per_token_acceptance(num_drafts: int, accepted_per_position: Sequence[int]) -> float | None:
    """Leviathan's alpha from the engine's raw counters: accepted draft tokens / draft positions the
    target looked at (position j of a draft is looked at when positions < j were all accepted).

    vLLM's acceptance rate, accepted / draft tokens, divides by every proposed token instead; with
    K = 4 and alpha = 0.5 it is (0.5 + 0.25 + 0.125 + 0.0625) / 4 = 0.23. Steps that proposed fewer
    than K tokens (at the end of a sequence) count as if they had proposed K: a slight overestimate."""
    if not num_drafts:
        return None
    reached = num_drafts + sum(accepted_per_position[:-1])
    return sum(accepted_per_position) / reached


def achievable_limit(
    mean_acceptance_length: float, t_target_step: float, t_draft_step: float, t_verify: float, k: int
) -> float:
    """The speedup measured forward times allow: E[tokens per step] t_target / (k t_draft + t_verify),
    i.e. tokens per second of a step made of forward passes only, over plain decoding's."""
    return mean_acceptance_length * t_target_step / (k * t_draft_step + t_verify)


def paired_ratio(numerator: Run | None, denominator: Run | None) -> float | None:
    """numerator's tokens/s over denominator's. Passes of the same round-robin round (same batch size,
    same number of passes) are paired: the median of the per-round ratios, as load from elsewhere,
    which drifts over seconds on a shared machine, slows both passes of a round alike. Otherwise the
    ratio of the median rates."""
    if numerator is None or denominator is None:
        return None
    rounds = paired_ratios(numerator, denominator)
    if not rounds:
        return ratio(numerator.tokens_per_second, denominator.tokens_per_second)
    return statistics.median(rounds)


def paired_ratios(numerator: Run, denominator: Run) -> list[float]:
    """numerator's tokens/s over denominator's in each round of passes (`paired_ratio`); empty where the
    runs' passes are not paired. Their spread is how far one round's noise moves the ratio."""
    if numerator.batch_size != denominator.batch_size or len(numerator.seconds) != len(denominator.seconds):
        return []
    rounds = zip(numerator.tokens, numerator.seconds, denominator.tokens, denominator.seconds, strict=True)
    return [(t1 / s1) / (t2 / s2) for t1, s1, t2, s2 in rounds if s1 > 0 and s2 > 0 and t2 > 0]


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
    cpu_rate = {name: run.tokens_per_cpu_second for name, run in runs.items()}
    spec, fixed, plain = runs["spec"], runs["spec_fixed"], runs["target_only"]
    assert spec.stats is not None and fixed.stats is not None
    t_target = forward_time(plain.forward_seconds(), "target:1", rows)
    t_draft = forward_time(fixed.forward_seconds(), "draft", rows)
    t_verify = forward_time(fixed.forward_seconds(), f"target:{k + 1}", rows)
    t_step = forward_time(fixed.forward_seconds(), f"step:{k}", rows)
    a, e = fixed.stats["acceptance_rate"], fixed.stats["mean_acceptance_length"]
    alpha = per_token_acceptance(fixed.stats["num_drafts"], fixed.stats["accepted_per_position"])
    c = ratio(t_draft, t_target)
    bound = leviathan_bound(alpha, c, k) if c is not None and alpha is not None else None
    limit = (
        achievable_limit(e, t_target, t_draft, t_verify, k)
        if t_target and t_draft and t_verify and fixed.stats["num_drafts"]
        else None
    )
    speedup_fixed = paired_ratio(fixed, plain)
    speedup_adaptive = paired_ratio(spec, plain)
    hybrid = runs.get(HYBRID_RUN)
    hybrid_stats = None if hybrid is None else hybrid.stats
    mismatches = compare_outputs({name: run.outputs for name, run in runs.items()}) if compare else None
    differing = {m["prompt"] for m in mismatches or []}

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1e3

    return asdict(
        BenchRow(
            batch_size=batch_size,
            rows=rows,
            **{f"{name}_tokens_per_s": rate.get(name) for name in RUNS},
            **{f"{name}_tokens_per_cpu_s": cpu_rate.get(name) for name in RUNS},
            spec_over_target_only=speedup_adaptive,
            spec_over_hf_batched=paired_ratio(spec, runs.get("hf_batched")),
            spec_over_hf_assisted=paired_ratio(spec, runs.get("hf_assisted")),
            target_only_over_hf_batched=paired_ratio(plain, runs.get("hf_batched")),
            acceptance_rate=a,
            alpha=alpha,
            mean_acceptance_length=e,
            spec_acceptance_rate=spec.stats["acceptance_rate"],
            spec_mean_acceptance_length=spec.stats["mean_acceptance_length"],
            spec_mean_k=mean_k(spec.k_steps),
            spec_k_steps={str(kk): n for kk, n in sorted((spec.k_steps or {}).items())},
            t_target_step_ms=ms(t_target),
            t_draft_step_ms=ms(t_draft),
            t_verify_ms=ms(t_verify),
            t_step_fixed_ms=ms(t_step),
            step_overhead_ms=ms(t_step - k * t_draft - t_verify) if t_step and t_draft and t_verify else None,
            cost_ratio=c,
            leviathan_bound=bound,
            achievable_limit=limit,
            speedup_fixed=speedup_fixed,
            speedup_adaptive=speedup_adaptive,
            efficiency_fixed=ratio(speedup_fixed, limit),
            efficiency_adaptive=ratio(speedup_adaptive, limit),
            hybrid_tokens_per_s=None if hybrid is None else hybrid.tokens_per_second,
            hybrid_over_target_only=paired_ratio(hybrid, plain),
            hybrid_acceptance_rate=None if hybrid_stats is None else hybrid_stats["acceptance_rate"],
            hybrid_acceptance_by_proposer=None if hybrid_stats is None else _by_proposer(hybrid_stats),
            same_output=None if mismatches is None else not mismatches,
            same_output_prompts=None if mismatches is None else len(plain.outputs) - len(differing),
            mismatches=mismatches,
        )
    )


def _by_proposer(stats: dict[str, Any]) -> dict[str, float]:
    """Acceptance by proposer, of those that proposed, from a run's summed counters (`_summed`)."""
    return {
        name: counters["accepted_tokens"] / counters["draft_tokens"]
        for name, counters in stats["by_proposer"].items()
        if counters["draft_tokens"]
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
    """`count` held-out code prompts (models/demo/corpus.py) and their token ids as the engine gets them."""
    from specq.models.demo import heldout_prompts
    from specq.models.loading import tokenize_prompt

    texts = heldout_prompts(count, prompt_chars)
    return texts, [tokenize_prompt(tokenizer, prompt=text) for text in texts]


def machine_info(device: str, dtype: str | None) -> dict[str, Any]:
    import transformers

    return {
        "cpu": cpu_name(),
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


def run_bench(
    target,
    draft,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    settings: BenchSettings,
    progress: Say = _quiet,
    reached: Say = _quiet,
) -> dict[str, Any]:
    """All runs at every batch size, the derived rows and the target checks, as one JSON-able dict.

    At each batch size every contender is warmed up first, then the timed passes go round-robin
    (spec, spec_fixed, target_only, spec_hybrid where asked, hf_batched, and hf_assisted with the first
    batch size), so that load from other processes, which drifts over minutes, hits every contender alike.
    `progress` gets a line as each pass begins, `reached` one as it finishes each prompt (or batch of them)."""
    k = settings.num_speculative_tokens
    sampling = settings.sampling
    greedy = sampling.greedy
    requests = [
        GenerationRequest(i, tuple(p), replace(sampling, seed=settings.seed + i)) for i, p in enumerate(prompts)
    ]
    eos_token_ids = SpeculativeEngine(target, tokenizer).eos_token_ids
    pad_token_id = _pad_token_id(tokenizer, eos_token_ids)
    hf_config = hf_baselines.generation_config(sampling, pad_token_id, eos_token_ids)

    assisted: Run | None = None
    rows: list[dict[str, Any]] = []
    all_runs: list[Run] = []
    for b in settings.batch_sizes:
        contenders: list[_Contender] = []
        for name in SPECQ_RUNS:
            config = DecodingConfig(num_speculative_tokens=k, fixed_k=name == "spec_fixed", batch_size=b)
            engine = SpeculativeEngine(target, tokenizer, None if name == "target_only" else draft, config)
            contenders.append(_EngineContender(Run(name, b), engine, requests))
        if settings.hybrid and draft is not None:
            hybrid_config = DecodingConfig(num_speculative_tokens=k, batch_size=b, model_free="suffix")
            make_engine = functools.partial(SpeculativeEngine, target, tokenizer, draft, hybrid_config)
            contenders.append(_FreshIndexContender(Run(HYBRID_RUN, b), make_engine, requests))
        if settings.hf_batched:
            batched = functools.partial(hf_baselines.batched_generate, target, prompts, b, hf_config, eos_token_ids)
            contenders.append(_BaselineContender(Run("hf_batched", b), batched, len(prompts)))
        if settings.hf_assisted and assisted is None:
            assisted = Run("hf_assisted", 1)
            contenders.append(
                _BaselineContender(
                    assisted,
                    functools.partial(
                        hf_baselines.assisted_generate,
                        target,
                        draft,
                        prompts,
                        hf_config,
                        eos_token_ids,
                        settings.hf_assistant_tokens,
                    ),
                    len(prompts),
                )
            )
        progress(f"B={b}: {', '.join(c.run.name for c in contenders)}")
        _measure(contenders, settings, progress, reached)
        runs = {c.run.name: c.run for c in contenders}
        for run in runs.values():
            progress(_line(run))
        all_runs.extend(runs.values())
        if assisted is not None:
            runs["hf_assisted"] = assisted
        rows.append(derive_row(b, min(b, len(prompts)), k, runs, compare=greedy))
        if greedy and not rows[-1]["same_output"]:
            logger.warning("batch %s: outputs differ: %s", b, rows[-1]["mismatches"])
    return {
        "rows": rows,
        "targets": check_targets(rows),
        "runs": [run.to_dict() for run in all_runs],
        # a draft head (decoding/draft_head.py) is no model HF's assisted generation could take
        "hf_assistant": hf_baselines.assistant_settings(draft, settings.hf_assistant_tokens)
        if hasattr(draft, "generation_config")
        else None,
        "eos_token_ids": sorted(eos_token_ids),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def default_pair() -> tuple[str, str]:
    """(target, draft): the catalogue names `specq bench` runs when given neither, as `specq demo-models`
    prints them."""
    from specq.models.catalogue import DEMO_DRAFT, DEMO_TARGET

    return DEMO_TARGET, DEMO_DRAFT


def load_bench_pair(
    target: str | None,
    draft: str | None,
    device: str | None,
    dtype: str | None,
    threads: int | None,
    progress: Say,
    compile: str = "off",
) -> tuple[Any, str, str, str | None]:
    """(pair, device, target, draft) for a benchmark: target None means the catalogue's demo pair
    (`default_pair`, pulled on first use), a target without a draft the target alone; `device` None: cuda
    if available, else cpu; `threads`: torch's intra-op threads. A pair that cannot be loaded raises SpecqError."""
    from specq.errors import SpecqError
    from specq.models.loading import load_pair

    if threads:
        torch.set_num_threads(threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if target is None:
            target, draft = default_pair()
            progress(f"using the demo pair: {target} and draft {draft} (pulled on first use)")
        progress(f"loading {target}" + ("" if draft is None else f" and the draft {draft}") + f" on {device}")
        pair = load_pair(target, draft, device, dtype, compile)
    except ValueError as exc:
        raise SpecqError(str(exc)) from exc
    compile_line = pair.compile_line()
    if compile_line is not None:
        progress(compile_line)  # the warm-up passes compile the rest, before anything is timed
    return pair, device, target, draft


def run_benchmark(
    target: str | None,
    draft: str | None,
    settings: BenchSettings,
    *,
    device: str | None = None,
    dtype: str | None = None,
    threads: int | None = None,
    compile: str = "off",
    command: str | None = None,
    progress: Say = _quiet,
    reached: Say = _quiet,
) -> dict[str, Any]:
    """The benchmark as `specq bench` runs it: load the pair (target and draft None: `default_pair`,
    pulled on first use), run `run_bench` on the held-out prompts, and return its results with what they were
    measured on (`command`, date, machine, models, settings, prompts) and the models' roofline, ready
    for report.py. `progress` and `reached`: as `run_bench` takes them.

    `threads`: torch's intra-op threads (None: torch's own choice); `device` None: cuda if available,
    else cpu. A pair that cannot be loaded raises SpecqError."""
    started = time.perf_counter()
    pair, device, target, draft = load_bench_pair(target, draft, device, dtype, threads, progress, compile)
    try:
        texts, prompts = prompt_token_ids(pair.tokenizer, settings.num_prompts, settings.prompt_chars)
    except ValueError as exc:
        from specq.errors import SpecqError

        raise SpecqError(str(exc)) from exc
    progress(
        f"{len(prompts)} prompts ({sum(map(len, prompts))} tokens), max_tokens {settings.max_tokens}, "
        f"K {settings.num_speculative_tokens}, batch sizes {','.join(map(str, settings.batch_sizes))}, {device}, "
        f"{torch.get_num_threads()} torch threads"
    )
    machine = machine_info(device, pair.dtype)  # what ran: `auto` chooses per machine and model
    results = run_bench(pair.target, pair.draft, pair.tokenizer, prompts, settings, progress, reached)
    bandwidth, roofline = measure_pair_roofline(pair, progress, settings.num_speculative_tokens + 1, reached)
    return {
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 1),
        "machine": {**machine, "memory_bandwidth_gb_s": bandwidth / 1e9, "load_average_end": list(os.getloadavg())},
        "models": {
            "target": target,
            "draft": draft,
            "target_params": _params(pair.target),
            "draft_params": _params(pair.draft),
        },
        "settings": {**vars(settings), "device": device, "dtype": machine["dtype"]},
        "prompts": [{"text": text, "prompt_tokens": len(ids)} for text, ids in zip(texts, prompts, strict=True)],
        "roofline": roofline,
        "compile": pair.compile_report(),  # None with --compile off
        **results,
    }


def measure_pair_roofline(
    pair, progress: Say, max_width: int = 1, reached: Say = _quiet
) -> tuple[float, dict[str, Any]]:
    """(memory bandwidth in bytes per second, roofline) of the pair's models (bench/roofline.py), with each
    model's forward time at widths 1 to `max_width`; `reached` notes each timed forward. Run after the
    benchmark, so that compiled models have their batch-1 graphs from the runs at B = 1."""
    from specq.bench.roofline import measure_roofline
    from specq.decoding.draft_head import DraftHead

    widths = f" at widths 1 to {max_width}" if max_width > 1 else ""
    progress(f"roofline: memory bandwidth, and batch-1 decode forwards of each model{widths}")
    # a draft head is no model of its own: it runs no decode forward, and its tables are the target's
    drafts = [] if isinstance(pair.draft, DraftHead) else [("draft", pair.draft)]
    models = {role: model for role, model in (("target", pair.target), *drafts) if model is not None}
    bandwidth, roofline = measure_roofline(models, max_width, lambda line: reached(f"roofline: {line}"))
    for row in roofline["models"]:  # what compiling each model cost at load and the speedup it measured
        outcome = pair.compiled.get(row["model"])
        row["compile_s"] = None if outcome is None or not outcome.compiled else outcome.seconds
        row["compile_speedup"] = None if outcome is None else outcome.speedup
    return bandwidth, roofline


def _params(model) -> int | None:
    return None if model is None else sum(p.numel() for p in model.parameters())


def _pad_token_id(tokenizer, eos_token_ids: Iterable[int]) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if isinstance(pad, int) else min(eos_token_ids, default=0)


class _Contender:
    """One way of decoding all `prompts` prompts: `once()` is one full pass."""

    def __init__(self, run: Run, prompts: int) -> None:
        self.run, self.prompts = run, prompts

    def once(self, on_prompts: PromptsDone) -> tuple[dict[int, list[int]], float]:
        """One full pass: the completions by prompt index, and its wall-clock seconds; `on_prompts` is
        told the prompts done and their tokens as the pass finishes each (or each batch of them)."""
        raise NotImplementedError

    def begin(self) -> None:
        """Called after the warm-up, before the first timed pass."""

    def end(self) -> None:
        """Called after the last timed pass."""


class _BaselineContender(_Contender):
    """An HF baseline (bench/hf_baselines.py): `generate(on_prompts=...)` is one full pass."""

    def __init__(self, run: Run, generate: Callable[..., hf_baselines.BaselineRun], prompts: int) -> None:
        super().__init__(run, prompts)
        self.generate = generate

    def once(self, on_prompts: PromptsDone) -> tuple[dict[int, list[int]], float]:
        result = self.generate(on_prompts=on_prompts)
        return result.outputs, result.seconds


class _EngineContender(_Contender):
    """A specq engine; its policy keeps what the warm-up measured, its stats cover the timed passes."""

    def __init__(self, run: Run, engine: SpeculativeEngine, requests: list[GenerationRequest]) -> None:
        super().__init__(run, len(requests))
        self.engine, self.requests = engine, requests

    def once(self, on_prompts: PromptsDone) -> tuple[dict[int, list[int]], float]:
        started = time.perf_counter()
        outputs = _collect(self.engine.generate(self.requests), on_prompts)
        return outputs, time.perf_counter() - started

    def begin(self) -> None:
        self.engine.reset_stats()

    def end(self) -> None:
        self.run.stats = self.engine.stats.to_dict()
        self.run.policy = _policy_snapshot(self.engine.policy)


class _FreshIndexContender(_Contender):
    """An engine per pass, sharing one adaptive-k policy, each with an empty suffix index."""

    def __init__(self, run: Run, make_engine: Callable[[SpeculationPolicy | None], SpeculativeEngine], requests):
        super().__init__(run, len(requests))
        self.make_engine, self.requests = make_engine, requests
        self.policy: SpeculationPolicy | None = None
        self.timed: list[EngineStats] = []
        self.timing = False

    def once(self, on_prompts: PromptsDone) -> tuple[dict[int, list[int]], float]:
        engine = self.make_engine(self.policy)
        self.policy = engine.policy
        started = time.perf_counter()
        outputs = _collect(engine.generate(self.requests), on_prompts)
        seconds = time.perf_counter() - started
        if self.timing:
            self.timed.append(engine.stats)
        return outputs, seconds

    def begin(self) -> None:
        self.timing = True

    def end(self) -> None:
        self.run.stats = _summed(self.timed)


def _summed(all_stats: list[EngineStats]) -> dict[str, Any]:
    """The timed passes' counters, summed; prefill seconds and decode forwards (one a step) per pass."""
    by_proposer = empty_by_proposer()
    k_steps: dict[int, int] = {}
    drafted = accepted = 0
    passes = max(len(all_stats), 1)
    for stats in all_stats:
        drafted += stats.num_draft_tokens
        accepted += stats.num_accepted_tokens
        for name, counters in stats.by_proposer.items():
            for key, value in counters.items():
                by_proposer[name][key] += value
        for k, n in stats.k_steps.items():
            k_steps[k] = k_steps.get(k, 0) + n
    return {
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "by_proposer": by_proposer,
        "k_steps": k_steps,
        "prefill_seconds": sum(stats.time_prefill_s for stats in all_stats) / passes,
        "decode_forwards": sum(stats.num_steps for stats in all_stats) / passes,
    }


def _measure(
    contenders: list[_Contender],
    settings: BenchSettings,
    progress: Say = _quiet,
    reached: Say = _quiet,
    where: str = "",
) -> None:
    """Each contender's warm-up passes, then the timed passes, round-robin; `where` names the workload in
    the progress lines (the draft axis)."""
    for contender in contenders:
        for n in range(1, settings.warmup + 1):
            _pass(contender, f"warm-up pass {n} of {settings.warmup}", where, progress, reached)
        contender.begin()
    for contender in contenders:
        contender.run.load_average.append(os.getloadavg()[0])
    for n in range(1, settings.repeats + 1):
        for contender in contenders:
            cpu = time.process_time()
            outputs, seconds = _pass(contender, f"timed pass {n} of {settings.repeats}", where, progress, reached)
            run = contender.run
            run.cpu_seconds.append(time.process_time() - cpu)
            run.seconds.append(seconds)
            run.tokens.append(sum(len(tokens) for tokens in outputs.values()))
            run.outputs = outputs
    for contender in contenders:
        contender.end()
        contender.run.load_average.append(os.getloadavg()[0])


def _pass(
    contender: _Contender, which: str, where: str, progress: Say, reached: Say
) -> tuple[dict[int, list[int]], float]:
    """One full pass of `contender`: a line as it begins, a note as it finishes each prompt (or batch)."""
    run = contender.run
    phase = f"{where}B={run.batch_size} {run.name}: {which}"
    progress(phase)
    return contender.once(prompts_noted(reached, phase, contender.prompts))


def prompts_noted(reached: Say, phase: str, prompts: int) -> PromptsDone:
    """An `on_prompts` that notes how far `phase` got: `...: 3/8 prompts done, 120 tokens`."""
    return lambda done, tokens: reached(f"{phase}: {done}/{prompts} prompts done, {tokens} tokens")


def _collect(results, on_prompts: PromptsDone) -> dict[int, list[int]]:
    outputs = {}
    tokens = 0
    for result in results:
        if result.error is not None:
            raise RuntimeError(f"request {result.key} failed: {result.error}")
        outputs[result.key] = result.token_ids
        tokens += len(result.token_ids)
        on_prompts(len(outputs), tokens)
    return outputs


def _policy_snapshot(policy: SpeculationPolicy) -> dict[str, Any]:
    """The policy's estimates, for diagnosis: alpha_j per draft position, and its step-time medians in ms
    (a step's drafting by its draft forwards, target forward by width, the rest of a step), by row count."""

    def ms(timing) -> float | None:  # a k_policy timing: its running median, None until measured
        return None if timing.value is None else round(timing.value * 1e3, 3)

    return {
        "alpha": [round(float(a), 4) for a in policy.acceptance()],
        "t_draft_ms": {
            str(rows): {str(n): ms(m) for n, m in sorted(by_forwards.items())}
            for rows, by_forwards in sorted(policy.t_draft.items())
        },
        "t_target_ms": {
            str(rows): {str(w): ms(m) for w, m in sorted(widths.items())}
            for rows, widths in sorted(policy.t_target.items())
        },
        "t_overhead_ms": {
            ("speculative" if speculative else "plain"): {str(rows): ms(m) for rows, m in sorted(table.items())}
            for speculative, table in policy.t_overhead.items()
        },
    }


def _line(run: Run) -> str:
    return (
        f"B={run.batch_size:<3} {run.name:<12} {run.tokens[-1]:>6} tokens in {statistics.median(run.seconds):7.2f}s "
        f"= {run.tokens_per_second:8.1f} tokens/s"
    )
