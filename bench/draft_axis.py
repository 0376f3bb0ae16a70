"""`specq bench --workloads ...`: the draft axis, side by side in one run.

For each workload (bench/workloads.py) and batch size B, on the same prompt token ids, greedy or
sampled alike for every contender:

    target_only   no proposer (plain batched decoding, k = 0);
    draft         the draft model, adaptive k;
    ngram         prompt lookup, adaptive k (decoding/model_free.py);
    suffix        the job's suffix index plus prompt lookup, adaptive k;
    hybrid        the draft model and the suffix index (plus prompt lookup), row by row in one verify pass;
    hf_generate   transformers' batched `generate`, the target alone (left-padded static batches);
    hf_assisted   transformers' assisted generation (`generate(assistant_model=draft)`) with the same draft
                  model, with HF's own candidate schedule; batch 1 only, the one batch size it decodes;
    hf_prompt_lookup  transformers' prompt lookup (`generate(prompt_lookup_num_tokens=...)`), batch 1 only.

The draft model's contenders (draft, hybrid, hf_assisted) run only where a draft model is given.

Each contender is warmed up once (its adaptive-k policy keeps what the warm-up measured), then the
timed passes take turns, as in bench/runner.py. Each pass starts from an EMPTY suffix index: the
warm-up's outputs of the same prompts would otherwise be replayed, which no real job gets. Greedy
outputs are compared with target-only's on every row.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from specq.bench import hf_baselines
from specq.bench.hf_baselines import PromptsDone
from specq.bench.runner import (
    Run,
    _BaselineContender,
    _Contender,
    _FreshIndexContender,
    _measure,
    _quiet,
    compare_outputs,
    mean_k,
    paired_ratio,
    paired_ratios,
    prompts_noted,
)
from specq.bench.workloads import workload_token_ids
from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.decoding.config import DRAFT_MODEL_SPECULATIVE_TOKENS, ModelFree
from specq.decoding.stats import PROPOSERS
from specq.decoding.suffix_index import SuffixIndex
from specq.errors import SpecqError
from specq.speaking import Say

# A completion ends in a loop where its last tokens, this many at least and two periods at least, repeat
# a period of up to _MAX_LOOP_PERIOD tokens: fewer tokens repeating are as likely an answer as a loop,
# and the demo pair's loops run up to a few tokens ("**kw, **kw, ...", "_data_data_...")
_MIN_LOOP_TOKENS = 8
_MAX_LOOP_PERIOD = 8
# contender (specq.limits.BENCH_DRAFTS) -> (uses the draft model, model-free proposer); the HF ones apart
DRAFTS: dict[str, tuple[bool, ModelFree | None]] = {
    "target_only": (False, None),
    "draft": (True, None),
    "ngram": (False, "ngram"),
    "suffix": (False, "suffix"),
    "hybrid": (True, "suffix"),
}
HF_CONTENDERS = ("hf_generate", "hf_assisted", "hf_prompt_lookup")
# transformers' own default for prompt lookup's candidates a step (its documentation's example uses 10)
HF_PROMPT_LOOKUP_TOKENS = 10


class _TimedBaselineContender(_BaselineContender):
    """An HF baseline that keeps, over its timed passes, where each pass's time went (`BaselineRun`)."""

    def __init__(self, run: Run, generate: Callable[..., hf_baselines.BaselineRun], prompts: int) -> None:
        super().__init__(run, generate, prompts)
        self.timed: list[hf_baselines.BaselineRun] = []
        self.timing = False

    def once(self, on_prompts: PromptsDone) -> tuple[dict[int, list[int]], float]:
        result = self.generate(on_prompts=on_prompts)
        if self.timing:
            self.timed.append(result)
        return result.outputs, result.seconds

    def begin(self) -> None:
        self.timing = True

    def end(self) -> None:
        passes = max(len(self.timed), 1)
        self.run.stats = {
            "prefill_seconds": sum(r.prefill_seconds for r in self.timed) / passes,
            "decode_forwards": sum(r.decode_forwards for r in self.timed) / passes,
        }


def run_draft_axis(
    target,
    draft,
    tokenizer,
    workloads: Sequence[str],
    drafts: Sequence[str],
    batch_sizes: Sequence[int],
    *,
    num_prompts: int,
    prompt_chars: int,
    max_tokens: int,
    temperature: float,
    seed: int,
    warmup: int,
    repeats: int,
    num_speculative_tokens: int | None = None,
    drop_loops: bool = False,
    progress: Say = _quiet,
    reached: Say = _quiet,
) -> dict[str, Any]:
    """Every contender of `drafts` (keys of DRAFTS; target_only always) on every workload and batch size;
    with `drop_loops`, on the prompts whose target-only greedy completion does not loop (`_without_loops`).
    `progress` gets a line as each pass begins, `reached` one as it finishes each prompt (runner.run_bench)."""
    from specq.bench.runner import BenchSettings

    names = ["target_only", *[d for d in drafts if d != "target_only" and _can_run(d, draft)]]
    settings = BenchSettings(batch_sizes=tuple(batch_sizes), warmup=warmup, repeats=repeats)
    rows: list[dict[str, Any]] = []
    prompt_counts: dict[str, int] = {}
    dropped: dict[str, int] = {}
    for workload in workloads:
        prompts = workload_token_ids(tokenizer, workload, num_prompts, prompt_chars)
        prompt_counts[workload] = sum(map(len, prompts))
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        requests = [GenerationRequest(i, tuple(p), replace(params, seed=seed + i)) for i, p in enumerate(prompts)]
        if drop_loops:
            phase = f"{workload}: one target-only greedy pass finds the completions that loop"
            progress(phase)
            kept = _without_loops(
                target, tokenizer, requests, max(batch_sizes), prompts_noted(reached, phase, len(requests))
            )
            dropped[workload] = len(requests) - len(kept)
            progress(f"{workload}: {dropped[workload]} of {len(requests)} prompts dropped, their completions loop")
            if not kept:
                raise SpecqError(f"every prompt of workload {workload!r} loops; none is left to time")
            requests = kept
        # no K given: each contender's own default (decoding.config), as `specq run` would use
        k_option: dict[str, Any] = (
            {} if num_speculative_tokens is None else {"num_speculative_tokens": num_speculative_tokens}
        )
        for b in batch_sizes:
            contenders: list[_Contender] = []
            for name in names:
                if name in HF_CONTENDERS:
                    if name == "hf_generate" or b == 1:
                        contenders.append(_hf_contender(name, b, target, draft, tokenizer, requests))
                    continue
                uses_draft, model_free = DRAFTS[name]
                config = DecodingConfig(batch_size=b, model_free=model_free, **k_option)

                def make_engine(policy, config=config, uses_draft=uses_draft):
                    return SpeculativeEngine(
                        target,
                        tokenizer,
                        draft if uses_draft else None,
                        config,
                        policy=policy,
                        suffix_index=SuffixIndex(),
                    )

                contenders.append(_FreshIndexContender(Run(name, b), make_engine, requests))
            progress(f"{workload} B={b}: {', '.join(c.run.name for c in contenders)}")
            _measure(contenders, settings, progress, reached, where=f"{workload} ")
            runs = {c.run.name: c.run for c in contenders}
            rows.append(_row(workload, b, runs, compare=params.greedy))
            progress(_summary(rows[-1]))
    return {"rows": rows, "prompt_tokens": prompt_counts, **({"dropped_loops": dropped} if drop_loops else {})}


def _can_run(name: str, draft) -> bool:
    """Whether contender `name` can run with `draft` (None: no draft): the draft's contenders need one, and
    transformers' assisted generation a draft model, not a draft head (decoding/draft_head.py)."""
    from specq.decoding.draft_head import DraftHead

    if name == "hf_assisted":
        return draft is not None and not isinstance(draft, DraftHead)
    return draft is not None or not (name in DRAFTS and DRAFTS[name][0])


def _hf_contender(
    name: str, batch_size: int, target, draft, tokenizer, requests: list[GenerationRequest]
) -> _Contender:
    """transformers' batched `generate`, its assisted generation with `draft` (batch 1) or its prompt lookup
    (batch 1) on the same token ids, greedy or sampled as the engine's requests are."""
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    params = requests[0].params
    pad = getattr(tokenizer, "pad_token_id", None)
    config = hf_baselines.generation_config(params, pad if isinstance(pad, int) else min(eos, default=0), eos)
    prompts = [r.prompt_token_ids for r in requests]
    generate: Callable[..., hf_baselines.BaselineRun]  # called with on_prompts=
    if name == "hf_generate":
        generate = functools.partial(hf_baselines.batched_generate, target, prompts, batch_size, config, eos)
    elif name == "hf_assisted":
        generate = functools.partial(hf_baselines.assisted_generate, target, draft, prompts, config, eos)
    else:
        lookup = HF_PROMPT_LOOKUP_TOKENS
        generate = functools.partial(hf_baselines.prompt_lookup_generate, target, prompts, config, eos, lookup)
    return _TimedBaselineContender(Run(name, batch_size), generate, len(prompts))


def _without_loops(
    target,
    tokenizer,
    requests: list[GenerationRequest],
    batch_size: int,
    on_prompts: PromptsDone = lambda done, tokens: None,
) -> list[GenerationRequest]:
    """The requests whose target-only greedy completion does not end in a loop (`repeats_a_short_period`),
    decided by one untimed pass (`on_prompts` told as it finishes each): on a weak model's loops every proposer
    predicts the loop, so acceptance there measures the loop, not the workload (the demo pair loops on most
    grounded prompts)."""
    greedy = [
        GenerationRequest(r.key, r.prompt_token_ids, SamplingParams(max_tokens=r.params.max_tokens, temperature=0.0))
        for r in requests
    ]
    engine = SpeculativeEngine(target, tokenizer, None, DecodingConfig(batch_size=batch_size))
    looping, tokens = set(), 0
    for done, result in enumerate(engine.generate(greedy), 1):
        tokens += len(result.token_ids)
        on_prompts(done, tokens)
        if repeats_a_short_period(result.token_ids):
            looping.add(result.key)
    return [r for r in requests if r.key not in looping]


def _row(workload: str, batch_size: int, runs: dict[str, Run], compare: bool) -> dict[str, Any]:
    plain = runs["target_only"]
    mismatches = compare_outputs({name: run.outputs for name, run in runs.items()}) if compare else None
    contenders = {}
    for name, run in runs.items():
        stats = run.stats or {}
        by_proposer = stats.get("by_proposer", {})
        rounds = paired_ratios(run, plain)
        contenders[name] = {
            "tokens_per_s": run.tokens_per_second,
            "over_target_only": paired_ratio(run, plain),
            # the lowest and highest round: a median inside this run's noise is no finding
            "over_target_only_range": [min(rounds), max(rounds)] if len(rounds) > 1 and name != "target_only" else None,
            "acceptance_rate": stats.get("acceptance_rate"),
            "acceptance_by_proposer": {
                p: c["accepted_tokens"] / c["draft_tokens"]
                for p, c in by_proposer.items()
                if p in PROPOSERS and c["draft_tokens"]
            },
            "draft_tokens_by_proposer": {p: c["draft_tokens"] for p, c in by_proposer.items() if c["draft_tokens"]},
            "mean_k": mean_k({int(k): n for k, n in stats.get("k_steps", {}).items()}),
            "same_output": None if mismatches is None else not any(m["run"] == name for m in mismatches),
            "seconds": statistics.median(run.seconds),
            # where a pass's time went: its prompts' prefill, and the target's decode forwards (steps)
            "prefill_seconds": stats.get("prefill_seconds"),
            "decode_forwards": stats.get("decode_forwards"),
            # completion tokens (all rows') per decode forward of the target: what each proposer saves
            "tokens_per_target_forward": (
                statistics.median(run.tokens) / stats["decode_forwards"] if stats.get("decode_forwards") else None
            ),
        }
    return {
        "workload": workload,
        "batch_size": batch_size,
        "contenders": contenders,
        "prompts": len(plain.outputs),
        "target_only_repetitive": sum(map(repeats_a_short_period, plain.outputs.values())),
        "same_output_all": None if mismatches is None else not mismatches,
        "mismatches": mismatches,
    }


def repeats_a_short_period(tokens: list[int]) -> bool:
    """Whether a completion ends in a loop: its last tokens repeat a period of a few tokens (a weak
    model's loop: newline after newline, an argument over and over). Every proposer predicts such a
    completion, so acceptance on it measures the loop."""
    for period in range(1, _MAX_LOOP_PERIOD + 1):
        length = max(_MIN_LOOP_TOKENS, 2 * period)
        tail = tokens[-length:]
        if len(tail) == length and tail[period:] == tail[:-period]:
            return True
    return False


def _repetition_notes(rows: list[dict[str, Any]]) -> list[str]:
    return [
        f"- {row['workload']} at batch {row['batch_size']}: {row['target_only_repetitive']} of {row['prompts']}"
        " target-only completions end in a loop (a few tokens over and over); acceptance there measures that loop,"
        " not the workload."
        for row in rows
        if row.get("target_only_repetitive")
    ]


def _summary(row: dict[str, Any]) -> str:
    parts = [
        f"{name} {c['tokens_per_s']:.1f} tok/s ({c['over_target_only']:.2f}x)" for name, c in row["contenders"].items()
    ]
    loops = (
        f" ({row['target_only_repetitive']} of {row['prompts']} completions loop)"
        if row["target_only_repetitive"]
        else ""
    )
    return f"{row['workload']} B={row['batch_size']}{loops}: " + "; ".join(parts)


def markdown(results: dict[str, Any]) -> str:
    """The table for docs/benchmarks.md: per workload and batch size, each contender's tokens/s, its
    speedup over target-only (the median round's, with the lowest and highest rounds' where there were
    several), its acceptance (split by proposer for the hybrid), greedy identity, where a pass's time
    went (its median seconds, of them the prefill (mean), and the target's decode forwards), the
    completion tokens per target forward, and the tokens/s that many tokens a forward would give if every
    target forward ran at its memory floor (bench/roofline.py; drafting and prefill left out): the
    distance to the limit."""
    floor_ms = _target_floor_ms(results)
    lines = [
        "| workload | B | contender | tokens/s | vs target-only (rounds) | acceptance | by proposer | mean k |"
        " same output | s a pass | prefill s | decode forwards | tokens / forward | at floor tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["rows"]:
        for name, c in row["contenders"].items():
            acceptance = "-" if c["acceptance_rate"] is None else f"{c['acceptance_rate']:.2f}"
            split = " ".join(f"{p}:{a:.2f}" for p, a in c["acceptance_by_proposer"].items()) or "-"
            k = "-" if c["mean_k"] is None else f"{c['mean_k']:.2f}"
            same = "n/a" if c["same_output"] is None else ("yes" if c["same_output"] else "NO")
            spread = c.get("over_target_only_range")
            speedup = f"{c['over_target_only']:.2f}x" + (f" ({spread[0]:.2f}-{spread[1]:.2f})" if spread else "")
            prefill = "-" if c.get("prefill_seconds") is None else f"{c['prefill_seconds']:.2f}"
            forwards = "-" if c.get("decode_forwards") is None else f"{c['decode_forwards']:.0f}"
            per_forward = c.get("tokens_per_target_forward")
            at_floor = "-" if per_forward is None or floor_ms is None else f"{per_forward / floor_ms * 1e3:.1f}"
            lines.append(
                f"| {row['workload']} | {row['batch_size']} | {name} | {c['tokens_per_s']:.1f} | "
                f"{speedup} | {acceptance} | {split} | {k} | {same} | {c['seconds']:.2f} | {prefill} | {forwards} | "
                f"{'-' if per_forward is None else f'{per_forward:.2f}'} | {at_floor} |"
            )
    notes = _repetition_notes(results["rows"]) + [
        f"- {workload}: {count} prompts dropped before timing (--drop-loops), their target-only completions loop."
        for workload, count in results.get("dropped_loops", {}).items()
    ]
    return "\n".join(lines + ([""] if notes else []) + notes) + "\n"


def _target_floor_ms(results: dict[str, Any]) -> float | None:
    """The target's batch-1 forward floor in ms (the roofline's), None where the results have none."""
    rows = results.get("roofline", {}).get("models", [])
    return next((row["floor_ms"] for row in rows if row["model"] == "target"), None)


def run_draft_axis_benchmark(
    target: str | None,
    draft: str | None,
    workloads: Sequence[str],
    drafts: Sequence[str],
    batch_sizes: Sequence[int],
    *,
    device: str | None = None,
    dtype: str | None = None,
    threads: int | None = None,
    compile: str = "off",
    command: str | None = None,
    progress: Say = _quiet,
    reached: Say = _quiet,
    **settings: Any,
) -> dict[str, Any]:
    """The draft axis as `specq bench --workloads` runs it: load the pair (None, None: runner.default_pair),
    run `run_draft_axis`, and return its results with the command, date, machine and models; `progress` and
    `reached` as `run_draft_axis` takes them."""
    import os
    from datetime import UTC, datetime

    from specq.bench.runner import load_bench_pair, machine_info, measure_pair_roofline

    started = time.perf_counter()
    pair, device, target, draft = load_bench_pair(target, draft, device, dtype, threads, progress, compile)
    machine = machine_info(device, pair.dtype)  # what ran: `auto` chooses per machine and model
    results = run_draft_axis(
        pair.target,
        pair.draft,
        pair.tokenizer,
        workloads,
        drafts,
        batch_sizes,
        progress=progress,
        reached=reached,
        **settings,
    )
    # a verify is K + 1 wide: the draft model's K where given, else its default (decoding.config)
    k = settings.get("num_speculative_tokens") or DRAFT_MODEL_SPECULATIVE_TOKENS
    bandwidth, roofline = measure_pair_roofline(pair, progress, k + 1, reached)
    return {
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - started, 1),
        "machine": {**machine, "memory_bandwidth_gb_s": bandwidth / 1e9, "load_average_end": list(os.getloadavg())},
        "models": {"target": target, "draft": draft},
        "settings": {
            **settings,
            "workloads": list(workloads),
            "drafts": list(drafts),
            "batch_sizes": list(batch_sizes),
        },
        "roofline": roofline,
        **results,
    }
