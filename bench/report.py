"""What `specq bench` shows: tables for humans (throughput; speculation analysis; each model's roofline),
JSON for scripts, and the same tables as Markdown for docs/benchmarks.md."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table

Format = Callable[[Any], str]
# (header, row key, format); the row key None means the whole row is formatted
Columns = list[tuple[str, str | None, Format]]


def _num(digits: int) -> Format:
    return lambda v: "-" if v is None else f"{v:.{digits}f}"


def _times(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _same(row: dict[str, Any]) -> str:
    if row["same_output"] is None:
        return "n/a (sampling)"
    total = row["same_output_prompts"] + len({m["prompt"] for m in row["mismatches"]})
    return f"{'yes' if row['same_output'] else 'NO'} {row['same_output_prompts']}/{total}"


def _by_width(v: dict[Any, float] | None) -> str:
    """'1:12.0 2:13.1 ...': a forward's milliseconds by its width in tokens (JSON makes the widths strings)."""
    return "-" if not v else " ".join(f"{width}:{ms:.1f}" for width, ms in v.items())


def _k_steps(v: dict[str, int]) -> str:
    total = sum(v.values())
    return " ".join(f"{k}:{100 * n / total:.0f}%" for k, n in v.items()) if total else "-"


THROUGHPUT: Columns = [
    ("B", "batch_size", str),
    ("spec tok/s", "spec_tokens_per_s", _num(1)),
    ("spec K tok/s", "spec_fixed_tokens_per_s", _num(1)),
    ("target-only tok/s", "target_only_tokens_per_s", _num(1)),
    ("HF batched tok/s", "hf_batched_tokens_per_s", _num(1)),
    ("HF assisted tok/s", "hf_assisted_tokens_per_s", _num(1)),
    ("spec / target-only", "spec_over_target_only", _times),
    ("spec / HF batched", "spec_over_hf_batched", _times),
    ("spec / HF assisted", "spec_over_hf_assisted", _times),
    ("target-only / HF batched", "target_only_over_hf_batched", _times),
    ("same output", None, _same),  # type: ignore[list-item]
]
CPU_RATES: Columns = [
    ("B", "batch_size", str),
    ("spec", "spec_tokens_per_cpu_s", _num(1)),
    ("spec K", "spec_fixed_tokens_per_cpu_s", _num(1)),
    ("target-only", "target_only_tokens_per_cpu_s", _num(1)),
    ("HF batched", "hf_batched_tokens_per_cpu_s", _num(1)),
    ("HF assisted", "hf_assisted_tokens_per_cpu_s", _num(1)),
]
ANALYSIS: Columns = [
    ("B", "batch_size", str),
    ("a (acc/draft)", "acceptance_rate", _num(3)),
    ("alpha", "alpha", _num(3)),
    ("mean acc. len", "mean_acceptance_length", _num(2)),
    ("t_target ms", "t_target_step_ms", _num(2)),
    ("t_draft ms", "t_draft_step_ms", _num(2)),
    ("t_verify(K+1) ms", "t_verify_ms", _num(2)),
    ("step overhead ms", "step_overhead_ms", _num(2)),
    ("c", "cost_ratio", _num(3)),
    ("Leviathan bound", "leviathan_bound", _times),
    ("achievable limit", "achievable_limit", _times),
    ("speedup K", "speedup_fixed", _times),
    ("eff. K", "efficiency_fixed", _num(2)),
    ("speedup adaptive", "speedup_adaptive", _times),
    ("eff. adaptive", "efficiency_adaptive", _num(2)),
    ("adaptive mean k", "spec_mean_k", _num(2)),
    ("adaptive k per step", "spec_k_steps", _k_steps),
]
ROOFLINE: Columns = [
    ("model", "model", str),
    ("weight MB", "weight_bytes", lambda v: f"{v / 1e6:.1f}"),
    ("floor ms", "floor_ms", _num(3)),
    ("eager forward ms", "eager_forward_ms", _num(3)),
    ("eager / floor", "eager_over_floor", _times),
    ("compiled forward ms", "compiled_forward_ms", _num(3)),
    ("compiled / floor", "compiled_over_floor", _times),
    ("compile s", "compile_s", _num(1)),  # at load: what every job runs first (decoding/compiled.py)
    ("compiled step speedup", "compile_speedup", _times),  # the measurement `auto` follows
    # a verify of K draft tokens is K + 1 wide: at the floor it costs what a step does
    ("eager ms by width", "eager_forward_ms_by_width", _by_width),
]
TableSpec = tuple[str, Columns, list[dict[str, Any]]]  # title, columns, rows


def _cells(columns: Columns, row: dict[str, Any]) -> list[str]:
    return [fmt(row) if key is None else fmt(row[key]) for _, key, fmt in columns]


def _tables(results: dict[str, Any]) -> list[TableSpec]:
    k = results["settings"]["num_speculative_tokens"]
    rows = results["rows"]
    return [
        ("Throughput (completion tokens per second, wall clock)", THROUGHPUT, rows),
        ("Tokens per CPU-second of this process (robust to other load only with --threads 1)", CPU_RATES, rows),
        (
            f"Speculation analysis (K = {k}; a, alpha, acceptance length, t_draft, t_verify: K-fixed run)",
            ANALYSIS,
            rows,
        ),
        roofline_table(results),
    ]


def roofline_table(results: dict[str, Any]) -> TableSpec:
    """The roofline of each model (bench/roofline.py): (title, columns, rows)."""
    roofline = results["roofline"]
    title = (
        f"Roofline (one batch-1 decode forward over a {roofline['context_tokens']}-token cache; floor = weight "
        f"bytes / the measured memory bandwidth, {results['machine']['memory_bandwidth_gb_s']:.1f} GB/s)"
    )
    return title, ROOFLINE, roofline["models"]


def print_tables(results: dict[str, Any], to_stderr: bool = False, file: TextIO | None = None) -> None:
    """The result tables for people: on stdout (so `specq bench > results.txt` keeps them), on stderr
    where stdout carries the JSON (`--json -`)."""
    console = Console(file=file, stderr=to_stderr, width=200)
    for title, columns, rows in _tables(results):
        table = Table(title=title, title_justify="left")
        for header, *_ in columns:
            table.add_column(header, justify="right", overflow="fold")
        for row in rows:
            table.add_row(*_cells(columns, row))
        console.print(table)
    failed = [check for check in results["targets"] if check["met"] is False]
    for check in results["targets"]:
        mark = {True: "[green]met[/]", False: "[red]MISSED[/]", None: "[yellow]n/a[/]"}[check["met"]]
        value = "-" if check["measured"] is None else f"{check['measured']:.2f}"
        console.print(f"  {mark:<20} {check['target']}: {value} (want {check['want']})")
    for row in results["rows"]:
        if row["same_output"] is False:
            console.print(
                f"[red]batch {row['batch_size']}: outputs differ from specq target-only:[/] {row['mismatches']}"
            )
    if failed:
        console.print(f"[red]{len(failed)} target(s) missed[/]")


def _markdown(title: str, columns: Columns, rows: list[dict[str, Any]]) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(h for h, *_ in columns) + " |"]
    lines.append("|" + "---:|" * len(columns))
    lines += ["| " + " | ".join(_cells(columns, row)) + " |" for row in rows]
    return "\n".join(lines)


def markdown_tables(results: dict[str, Any]) -> str:
    parts = [_markdown(*table) for table in _tables(results)]
    checks = ["| target | want | measured | met |", "| --- | --- | ---: | --- |"]
    for check in results["targets"]:
        value = "-" if check["measured"] is None else f"{check['measured']:.2f}"
        met = {True: "yes", False: "**no**", None: "n/a"}[check["met"]]
        checks.append(f"| {check['target']} | {check['want']} | {value} | {met} |")
    parts.append("\n".join(checks))
    return "\n\n".join(parts) + "\n"


def roofline_markdown(results: dict[str, Any]) -> str:
    """The roofline table alone, for reports with tables of their own (the draft axis)."""
    return _markdown(*roofline_table(results)) + "\n"


def write_json(results: dict[str, Any], path: str) -> None:
    """Write the results to `path` ("-": stdout)."""
    text = json.dumps(results, indent=2) + "\n"
    if path == "-":
        import click

        click.echo(text, nl=False)
    else:
        Path(path).write_text(text)


def write_markdown(results: dict[str, Any], path: str) -> None:
    Path(path).write_text(markdown_tables(results))
