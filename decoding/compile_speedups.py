"""What compiling a model measured on this machine, and the rule by which `--compile auto` on a CPU
follows it.

On a GPU a compiled forward always pays: an eager step is launch-bound. On a CPU the gain depends on
the model's size and on the CPU itself: the same 2.75M-parameter draft's forward ran 1.49x faster
compiled on one 2-core VM and 1.16x on another (docs/benchmark-log/2026-12.md, "Compiled forwards"),
and one timing on a shared machine is noise: the same target measured 0.36x busy and 1.64x quiet,
ninety minutes apart. So a measurement (`SpeedupMeasurement`) is many rounds taken in turns, eager and
compiled side by side in each round with their order alternating, each side the best of a few calls: a
busy spell slows both sides of a round alike, and the best of a few calls is the one least disturbed.
Its spread is the rounds' quartiles.

`decide` is the rule: compile where the lower quartile of the rounds is at least `MIN_SPEEDUP` (three
rounds in four measured the compiled step that much faster), run eagerly otherwise. A measurement
whose spread straddles the threshold so decides for eager: the compile is not free, and a gain inside
the noise is not one to pay a minute for.

A measurement is kept under a key of what decides it: the model's config (its shape, not its weights or
where it was loaded from), its dtype and device, the compiler backend, what was compiled (the whole
forward or the decoder layer), the CPU, torch's version, its thread count and this module's
`PROTOCOL`. It is made once for a key, by the first `--compile on` process that finds none (at load,
or after its first tokens: decoding/compiled.py), and never again: later loads, `on` and `auto`, read
it, so `auto` does not flip with the machine's load from one run to the next. A model of another
config, a new torch, another machine or a changed protocol is measured afresh.

One JSON file in specq's data directory, next to inductor's compiled artefacts. It is replaced whole
(os.replace), so a reader never sees half of it; two processes recording at once may lose one entry,
which the next compile of that model measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from specq.decoding.hf_model import CausalLM
from specq.machine_records import cpu_name, read_entries, write_entries
from specq.paths import data_dir

log = logging.getLogger(__name__)

FILE_NAME = "compile-speedups.json"

# bumped when the measurement changes: records of an older protocol (one noisy timing) are measured afresh
PROTOCOL = 2

# `auto` on a CPU compiles where three rounds in four measured a decode step at least this much faster:
# below it the gain is inside a 2-core VM's run-to-run noise, and the compile itself is not free
MIN_SPEEDUP = 1.05

ROUNDS = 9  # interleaved rounds a measurement takes; its spread is their quartiles
CALLS = 3  # calls a side makes in a round, the best of which counts


@dataclass(frozen=True)
class SpeedupMeasurement:
    """Eager over compiled seconds of a decode step, one ratio per interleaved round."""

    ratios: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def spread(self) -> tuple[float, float]:
        """The rounds' lower and upper quartiles."""
        if len(self.ratios) < 2:
            return self.ratios[0], self.ratios[0]
        low, _, high = statistics.quantiles(self.ratios, n=4, method="inclusive")
        return low, high

    def describe(self) -> str:
        low, high = self.spread
        return f"{self.median:.2f}x eager's speed ({low:.2f}-{high:.2f} over {len(self.ratios)} rounds)"


@dataclass(frozen=True)
class Decision:
    compile: bool
    why: str


def decide(measurement: SpeedupMeasurement, threshold: float = MIN_SPEEDUP) -> Decision:
    """Compile where the lower quartile of the rounds is at least `threshold`."""
    low, _ = measurement.spread
    if low >= threshold:
        return Decision(True, f"a decode step measured {measurement.describe()} here, at least {threshold:.2f}x")
    return Decision(False, f"a decode step measured {measurement.describe()} here, not surely {threshold:.2f}x")


def measure(sides: Sequence[Callable[[], float]], rounds: int = ROUNDS, calls: int = CALLS) -> SpeedupMeasurement:
    """Time `sides` (eager, compiled: each runs one step and returns its seconds) in `rounds` rounds; in
    each, both sides make `calls` calls, in the order eager-compiled in one round and compiled-eager in
    the next, so that neither always runs on the caches (or in the quiet) the other left; a round's ratio
    is the eager side's best over the compiled side's best."""
    eager, compiled = sides
    ratios = []
    for round_ in range(rounds):
        order = (eager, compiled) if round_ % 2 == 0 else (compiled, eager)
        best = {side: min(side() for _ in range(calls)) for side in order}
        ratios.append(best[eager] / best[compiled])
    return SpeedupMeasurement(tuple(ratios))


def speedup_key(model: CausalLM, backend: str, regions: bool = False) -> str:
    """What a compiled forward's speedup depends on, hashed; `regions`: its decoder layer compiled
    (decoding/compiled_regions.py), not its whole forward."""
    parameter = next(model.parameters())
    config = model.config.to_dict()
    for where_from in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config.pop(where_from, None)
    decides = {
        "config": config,
        "dtype": str(parameter.dtype),
        "device": _device_name(parameter.device),
        "backend": backend,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "protocol": PROTOCOL,
    }
    if regions:  # a whole forward's key is as it was, so that its kept measurements still count
        decides["compiled"] = "decoder layer"
    return hashlib.sha256(json.dumps(decides, sort_keys=True, default=str).encode()).hexdigest()[:32]


def recorded_measurement(key: str) -> SpeedupMeasurement | None:
    """The measurement kept for `key` on this machine, or None."""
    entry = _read().get(key)
    try:
        ratios = tuple(float(ratio) for ratio in entry["ratios"])  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        return None
    return SpeedupMeasurement(ratios) if ratios else None


def record_measurement(key: str, model_name: str, measurement: SpeedupMeasurement) -> None:
    entries = _read()
    low, high = measurement.spread
    entries[key] = {
        "model": Path(model_name).name,  # for whoever reads the file; the key is what counts
        "ratios": [round(ratio, 4) for ratio in measurement.ratios],
        "median": round(measurement.median, 4),
        "spread": [round(low, 4), round(high, 4)],
        "compile": decide(measurement).compile,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average": [round(load, 2) for load in os.getloadavg()],
    }
    write_entries(_path(), entries)


def _read() -> dict[str, Any]:
    return read_entries(_path())


def _path() -> Path:
    return data_dir() / FILE_NAME


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} x{os.cpu_count()}"
