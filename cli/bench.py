"""`specq bench`: the side-by-side benchmark. Parses options and delegates to bench/.

Its lines go to stderr, its tables to stdout. Each pass of each contender says a line as it begins and how
far it got at least every half minute; a silence inside one slow call (a model's load, a batch's `generate`)
gets a `still` line from the speaker's watcher (specq/speaking.py)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import click

from specq.cli.group import cli
from specq.cli.options import compile_option, float_range, int_range, specq_errors
from specq.limits import (
    BENCH_DRAFTS,
    BENCH_SPECULATIVE_TOKENS,
    BENCH_WORKLOADS,
    MAX_TOKENS,
    TEMPERATURE,
)
from specq.speaking import Phases, Speaker


def _batch_sizes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"batch sizes must be positive integers, got {value!r}")
    return sizes


def _choices(allowed: tuple[str, ...]) -> Callable[[click.Context, click.Parameter, str | None], tuple[str, ...]]:
    def parse(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
        if value is None:
            return ()
        chosen = tuple(part.strip() for part in value.split(",") if part.strip())
        unknown = [part for part in chosen if part not in allowed]
        if unknown or not chosen:
            raise click.BadParameter(f"{', '.join(unknown) or 'nothing'}: choose from {', '.join(allowed)}")
        return chosen

    return parse


@cli.command("bench")
@click.option(
    "--target",
    envvar="SPECQ_TARGET",
    help="Target model (catalogue name, HF id, folder or GGUF file). [env: SPECQ_TARGET; default: "
    "qwen2.5-coder-1.5b-instruct, pulled on first use]",
)
@click.option(
    "--draft",
    envvar="SPECQ_DRAFT",
    help="Draft model (catalogue name, HF id, folder or GGUF file). [env: SPECQ_DRAFT; default: "
    "qwen2.5-coder-0.5b-instruct with the default target; with --workloads "
    "and a --target, none (the draft model's contenders are left out)]",
)
@click.option(
    "--batch-sizes",
    default="1,4,16",
    show_default=True,
    callback=_batch_sizes,
    help="Comma-separated batch sizes; every way of decoding runs at each.",
)
@click.option(
    "--num-prompts",
    type=click.IntRange(min=1),
    help="Held-out code prompts decoded per run. Default: twice the largest batch size.",
)
@click.option("--max-tokens", type=int_range(MAX_TOKENS), default=64, show_default=True, help="New tokens per prompt.")
@click.option(
    "--num-speculative-tokens",
    "-k",
    type=int_range(BENCH_SPECULATIVE_TOKENS),
    help="K: the most draft tokens a step proposes (the K-fixed run always proposes K). Default: 4; with "
    "--workloads, each contender's own default, as `specq run` has it (for the model-free ones 16 at batch "
    "sizes up to 4, else 8).",
)
@click.option(
    "--temperature",
    type=float_range(TEMPERATURE),
    default=0.0,
    show_default=True,
    help="Sampling temperature; 0 is greedy, where all outputs are checked to be identical.",
)
@click.option("--device", help="Torch device, e.g. cpu or cuda:0. Default: cuda if available, else cpu.")
@click.option(
    "--dtype", help="auto, float32, bfloat16 or float16, as `run` takes it. Default: auto (the results say which ran)."
)
@click.option("--threads", type=click.IntRange(min=1), help="Torch intra-op threads. Default: torch's own choice.")
@click.option(
    "--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="Untimed passes before each timed one."
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Timed passes, round-robin over the ways of decoding: rates are medians, ratios the median of "
    "the per-round ratios.",
)
@click.option(
    "--prompt-chars", type=click.IntRange(min=32), default=256, show_default=True, help="Length of each prompt."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Base sampling seed (prompt i uses seed + i).")
@click.option("--skip-hf-batched", is_flag=True, help="Do not run HF batched generate.")
@click.option("--skip-hf-assisted", is_flag=True, help="Do not run HF assisted generation.")
@click.option(
    "--hf-assistant-tokens",
    type=click.IntRange(min=1),
    help="Candidate tokens per step for HF assisted generation. Default: HF's own (20, confidence-gated).",
)
@click.option(
    "--workloads",
    callback=_choices(BENCH_WORKLOADS),
    help=f"Run the draft axis on these workloads ({', '.join(BENCH_WORKLOADS)}; comma-separated) instead of the "
    "comparison with HF: every contender of --drafts side by side, at each batch size.",
)
@click.option(
    "--drafts",
    default=",".join(BENCH_DRAFTS),
    show_default=True,
    callback=_choices(BENCH_DRAFTS),
    help="With --workloads: the contenders (the draft axis): target-only, the draft model, prompt lookup, "
    "the suffix index, the hybrid of the draft model with the suffix index, transformers' batched generate "
    "and its prompt lookup (batch 1 only).",
)
@click.option(
    "--drop-loops",
    is_flag=True,
    help="With --workloads: time only the prompts whose target-only greedy completion does not end in a loop (a "
    "few tokens over and over: a weak model's, which every proposer predicts); one untimed pass decides.",
)
@compile_option(
    "off",
    "Compiled forwards for every contender (as run/submit --compile); on also keeps each model's measured "
    "speedup for later auto runs.",
)
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), help="Write the full results as JSON here ('-': stdout)."
)
@click.option(
    "--markdown", "markdown_path", type=click.Path(dir_okay=False), help="Write the result tables as Markdown here."
)
def bench(
    target: str | None,
    draft: str | None,
    batch_sizes: tuple[int, ...],
    num_prompts: int | None,
    max_tokens: int,
    num_speculative_tokens: int | None,
    temperature: float,
    device: str | None,
    dtype: str | None,
    threads: int | None,
    warmup: int,
    repeats: int,
    prompt_chars: int,
    seed: int,
    skip_hf_batched: bool,
    skip_hf_assisted: bool,
    hf_assistant_tokens: int | None,
    workloads: tuple[str, ...],
    drafts: tuple[str, ...],
    drop_loops: bool,
    compile: str,
    json_path: str | None,
    markdown_path: str | None,
) -> None:
    """Benchmark specq (adaptive k, fixed K, target only) against HF batched and assisted generation.

    Same prompts and settings for every run, at each batch size; prints throughput, acceptance, the
    measured draft/target cost ratio, the Leviathan bound and the limit these forward times allow, and
    each model's batch-1 forward time over its memory-bandwidth floor.
    """
    if target is None and draft is not None:
        raise click.UsageError("--draft needs --target (neither: the catalogue's demo pair, as `specq demo-models`)")
    if target is not None and draft is None and not workloads:
        raise click.UsageError("the comparison with HF needs --draft too; --workloads takes a target alone")
    if drop_loops and not workloads:
        raise click.UsageError("--drop-loops applies to the draft axis: give --workloads too")
    from specq.bench import report, runner

    command = shlex.join(["specq", *sys.argv[1:]]) if sys.argv[0].endswith("specq") else None
    speaker = Speaker(lambda line: click.echo(line, err=True))
    phases = Phases(speaker, "starting the benchmark")
    # how the pair is loaded and the run reported: the same for both benchmarks
    loading: dict[str, Any] = {
        "device": device,
        "dtype": dtype,
        "threads": threads,
        "compile": compile,
        "command": command,
        "progress": phases.begin,
        "reached": phases.reached,
    }
    # what both benchmarks measure with
    common: dict[str, Any] = {
        "num_prompts": num_prompts or 2 * max(batch_sizes),
        "prompt_chars": prompt_chars,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "warmup": warmup,
        "repeats": repeats,
    }
    if num_speculative_tokens is not None:
        common["num_speculative_tokens"] = num_speculative_tokens
    if workloads:
        _draft_axis(
            target,
            draft,
            workloads,
            drafts,
            batch_sizes,
            loading,
            speaker.watching(phases.busy),
            json_path=json_path,
            markdown_path=markdown_path,
            drop_loops=drop_loops,
            **common,
        )
        return

    try:
        settings = runner.BenchSettings(
            batch_sizes=batch_sizes,
            **common,
            hf_batched=not skip_hf_batched,
            hf_assisted=not skip_hf_assisted,
            hf_assistant_tokens=hf_assistant_tokens,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    # a model that cannot load, or cannot compile with --compile on: exit 2
    with specq_errors(), speaker.watching(phases.busy):
        results = runner.run_benchmark(target, draft, settings, **loading)
    report.print_tables(results, to_stderr=json_path == "-")
    if json_path:
        report.write_json(results, json_path)
    if markdown_path:
        report.write_markdown(results, markdown_path)


def _draft_axis(
    target: str | None,
    draft: str | None,
    workloads: tuple[str, ...],
    drafts: tuple[str, ...],
    batch_sizes: tuple[int, ...],
    loading: dict[str, Any],
    watched: AbstractContextManager[None],
    *,
    json_path: str | None,
    markdown_path: str | None,
    **settings: Any,
) -> None:
    """`bench --workloads`: the draft axis, with the benchmark's own settings (`settings`), run `watched`."""
    from specq.bench import draft_axis, report

    with specq_errors(), watched:
        results = draft_axis.run_draft_axis_benchmark(
            target, draft, workloads, drafts, batch_sizes, **loading, **settings
        )
    table = draft_axis.markdown(results) + "\n" + report.roofline_markdown(results)
    click.echo(table, err=json_path == "-")  # the results on stdout, unless it carries the JSON
    if json_path:
        report.write_json(results, json_path)
    if markdown_path:
        with open(markdown_path, "w", encoding="utf-8") as handle:
            handle.write(table)
