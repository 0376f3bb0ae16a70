"""The held-out measurement: the trained draft against target-only on prompts it never trained on,
with `specq bench`'s own runner (bench/runner.py: warm-up passes, then timed passes taking turns, rates
from the wall clock, greedy outputs compared token for token with target-only's).

The draft is loaded from DIR exactly as `--draft DIR` loads it, so the measurement also proves the
folder works. Beside the draft alone it measures the draft with prompt lookup and the suffix index
(`--draft DIR --model-free suffix`, the hybrid), and the command says which of the two was the faster:
on chat answers that copy their prompts' phrases the hybrid takes both (SmolLM2's 1,000-prompt head,
docs/draft-train.md: 1.58x target-only at batch 1 against the head's 1.44x, 1.10-1.15x at batch 16
against 1.04-1.06x)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from specq.distill.settings import DistillSettings

# The numbers of each batch size's row that the command reports (bench/runner.py names them).
REPORTED = (
    "batch_size",
    "acceptance_rate",
    "spec_acceptance_rate",
    "mean_acceptance_length",
    "speedup_fixed",
    "spec_over_target_only",
    "target_only_tokens_per_s",
    "spec_tokens_per_s",
    "hybrid_acceptance_rate",
    "hybrid_over_target_only",
    "same_output",
)
HYBRID_FLAGS = "--model-free suffix"  # how `run` and `submit` take the draft beside the model-free proposers


def evaluate_draft(
    settings: DistillSettings,
    draft_dir: str,
    prompts: Sequence[Sequence[int]],
    progress: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """The draft in `draft_dir` with the target on the held-out `prompts` (token ids), at each of the
    settings' evaluation batch sizes, greedy unless the settings sample: one row per batch size, its
    speed-ups the median of the rounds' ratios where there are several (`eval_repeats`); the
    models compiled as `eval_compile` says, so target-only is as fast as the user would run it."""
    from specq.bench.runner import BenchSettings, run_bench
    from specq.models.loading import load_pair, resolve_device

    pair = load_pair(settings.target, draft_dir, resolve_device(settings.device), settings.dtype, settings.eval_compile)
    sampling = settings.sampling
    bench = BenchSettings(
        batch_sizes=settings.eval_batch_sizes,
        num_prompts=len(prompts),
        max_tokens=sampling.max_tokens,
        num_speculative_tokens=settings.num_speculative_tokens,
        temperature=sampling.temperature,
        warmup=settings.eval_warmup,
        repeats=settings.eval_repeats,
        seed=BenchSettings.seed if sampling.seed is None else sampling.seed,  # no seed: the bench's base seed
        hf_batched=False,
        hf_assisted=False,
        hybrid=True,
    )
    results = run_bench(pair.target, pair.draft, pair.tokenizer, prompts, bench, progress=progress)
    return {
        "prompts": len(prompts),
        "max_tokens": bench.max_tokens,
        "temperature": bench.temperature,
        "num_speculative_tokens": bench.num_speculative_tokens,
        "repeats": bench.repeats,
        # whether both sides ran the compiled target; a run finished by an earlier release did not record it
        "compiled": "target" in pair.compiled and pair.compiled["target"].compiled,
        "rows": [{name: row.get(name) for name in REPORTED} for row in results["rows"]],
    }


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The held-out measurement as the command prints it, one line per batch size."""
    how = "greedy" if report["temperature"] == 0 else f"T={report['temperature']:g}"
    repeats = report.get("repeats", 1)  # a run finished by an earlier release did not record it
    rounds = f", the median of {repeats} rounds" if repeats > 1 else ""
    compiled = report.get("compiled")
    forwards = "" if compiled is None else (", the target compiled" if compiled else ", the target eager")
    lines = []
    for row in report["rows"]:
        same = row["same_output"]
        check = "" if same is None else ("; outputs identical to target-only" if same else "; OUTPUTS DIFFER")
        lines.append(
            f"held-out ({report['prompts']} prompts, {how}, K={report['num_speculative_tokens']}, batch "
            f"{row['batch_size']}{forwards}): acceptance {_number(row['acceptance_rate'])} (K fixed), "
            f"{_number(row['spec_acceptance_rate'])} (adaptive); speed-up over target-only "
            f"{_number(row['spec_over_target_only'], 'x')} (adaptive), {_number(row['speedup_fixed'], 'x')} (K fixed)"
            f"{_hybrid_part(row)}{rounds}{check}"
        )
    return lines


def _hybrid_part(row: dict[str, Any]) -> str:
    if row.get("hybrid_over_target_only") is None:  # a run finished by an earlier release did not measure it
        return ""
    return (
        f"; with {HYBRID_FLAGS}: acceptance {_number(row['hybrid_acceptance_rate'])}, "
        f"{_number(row['hybrid_over_target_only'], 'x')}"
    )


def _hybrid_faster_at(report: dict[str, Any]) -> list[int]:
    """The batch sizes at which the draft beside the model-free proposers was faster than the draft alone
    (adaptive k both) on the held-out prompts."""
    return [
        row["batch_size"]
        for row in report["rows"]
        if row.get("hybrid_over_target_only") is not None
        and row["spec_over_target_only"] is not None
        and row["hybrid_over_target_only"] > row["spec_over_target_only"]
    ]


def usage_line(report: dict[str, Any], draft_dir: str) -> str:
    """How to use the draft, as the held-out measurement found it faster: alone, or beside prompt lookup
    and the suffix index at the batch sizes where that was the faster."""
    use = f"draft written to {draft_dir}: use it with --draft {draft_dir}"
    faster = _hybrid_faster_at(report)
    if not faster:
        return use
    measured = [row["batch_size"] for row in report["rows"]]
    sizes = ", ".join(map(str, faster))
    if faster == measured:
        return f"{use} {HYBRID_FLAGS} (the faster on the held-out prompts, at batch {sizes})"
    return f"{use}, and {HYBRID_FLAGS} beside it at batch sizes like {sizes} (the faster there on the held-out prompts)"


def _number(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.3f}{unit}" if not unit else f"{value:.2f}{unit}"
