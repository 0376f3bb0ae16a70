"""`--dtype auto` on a CPU: bf16 where it pays, else fp32.

A CPU with native bf16 arithmetic (x86's AVX512-BF16 or AMX-BF16, Arm's BF16) multiplies bf16 matrices
in hardware and reads half the bytes of fp32, so a decode step may well run faster in bf16 there; one
without converts every bf16 element to fp32 and back in software, and bf16 only costs time. So `auto` on
a CPU is fp32 where the CPU has no native bf16, decided from its flags without measuring; where it has,
bf16 if a one-time measurement of a forward in both dtypes shows bf16 surely faster (the lower quartile
of interleaved rounds at least `MIN_SPEEDUP`, decoding/compile_speedups.py's protocol), else fp32.

A measurement is kept as `--compile auto`'s are: once per key of what decides it (the model's config,
not its weights or where it came from; the CPU; torch's version and thread count; `PROTOCOL`), in one
JSON file in specq's data directory, replaced whole, so `auto` does not flip with the machine's load from
one run to the next. On CUDA `auto` is bf16, as before (models/loading.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specq.machine_records import cpu_name, read_entries, write_entries
from specq.paths import data_dir

if TYPE_CHECKING:
    from specq.decoding.compile_speedups import SpeedupMeasurement

log = logging.getLogger(__name__)

FILE_NAME = "cpu-dtype.json"
PROTOCOL = 1  # bumped when the measurement changes: older records are measured afresh
# bf16 where three rounds in four measured it at least this much faster: below it the gain is inside a
# shared machine's run-to-run noise, and bf16 rounds the logits, which fp32 does not
MIN_SPEEDUP = 1.05
# /proc/cpuinfo flags of native bf16 arithmetic: x86 (`flags`) and Arm (`Features`)
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
MEASURED_TOKENS = 8  # a forward over this many positions: every weight read once, as in a decode step


@dataclass(frozen=True)
class DtypeChoice:
    """What `auto` chose on a CPU (a torch dtype's name) and why, in words for the logs and `status`."""

    dtype: str
    why: str
    measured: bool = False  # this call measured (once per model and machine), rather than read a record


def choose(
    config: Any,
    measure: Callable[[], SpeedupMeasurement],
    native: Callable[[], bool] | None = None,
) -> DtypeChoice:
    """`auto`'s dtype on a CPU for a model of `config`: fp32 without measuring where `native()` (default:
    the CPU's flags) says the CPU has no native bf16; else what the kept measurement for this key says,
    measuring with `measure()` (a compile_speedups.SpeedupMeasurement of fp32 over bf16 seconds) and keeping
    it where none is kept."""
    if not (native or has_native_bf16)():
        return DtypeChoice("float32", "the CPU has no native bf16 (avx512_bf16, amx_bf16)")
    key = dtype_key(config)
    kept = _read().get(key)
    if isinstance(kept, dict) and isinstance(kept.get("dtype"), str) and isinstance(kept.get("why"), str):
        return DtypeChoice(kept["dtype"], kept["why"])
    measurement = measure()
    choice = _decide(measurement)
    _record(key, choice, measurement)
    return DtypeChoice(choice.dtype, choice.why, measured=True)


def _decide(measurement: SpeedupMeasurement) -> DtypeChoice:
    low, _ = measurement.spread
    speed = f"bf16 measured {measurement.median:.2f}x fp32's speed ({low:.2f} in three rounds of four)"
    if low >= MIN_SPEEDUP:
        return DtypeChoice("bfloat16", f"{speed} on this CPU")
    return DtypeChoice("float32", f"{speed} on this CPU, not surely {MIN_SPEEDUP:.2f}x")


def measure_bf16_speedup(model: Any) -> SpeedupMeasurement:
    """fp32 over bf16 seconds of a forward of `model` (in fp32, on the CPU) and of a bf16 copy of it, in
    interleaved rounds (decoding/compile_speedups.measure)."""
    import copy
    import time

    import torch

    from specq.decoding.compile_speedups import measure

    fp32_model = model.float()
    bf16_model = copy.deepcopy(fp32_model).to(torch.bfloat16)
    input_ids = torch.zeros(1, MEASURED_TOKENS, dtype=torch.long)  # [1, tokens]

    def timed(candidate: Any) -> Callable[[], float]:
        def forward() -> float:
            started = time.perf_counter()
            with torch.no_grad():
                candidate(input_ids=input_ids, use_cache=False)
            return time.perf_counter() - started

        return forward

    timed(bf16_model)()  # the first call of a dtype pays for its kernels' set-up, not for its arithmetic
    timed(fp32_model)()
    return measure((timed(fp32_model), timed(bf16_model)))


def has_native_bf16() -> bool:
    return bool(cpu_flags() & NATIVE_BF16_FLAGS)


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); empty where there is none to read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                label, _, value = line.partition(":")
                if label.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def dtype_key(config: Any) -> str:
    """What a model's bf16 speedup on this CPU depends on, hashed."""
    import torch

    described = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    for where_from in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        described.pop(where_from, None)
    decides = {
        "config": described,
        "cpu": f"{cpu_name()} x{os.cpu_count()}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "protocol": PROTOCOL,
    }
    return hashlib.sha256(json.dumps(decides, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _record(key: str, choice: DtypeChoice, measurement: SpeedupMeasurement) -> None:
    entries = _read()
    entries[key] = {
        "dtype": choice.dtype,
        "why": choice.why,
        "ratios": [round(float(ratio), 4) for ratio in measurement.ratios],
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average": [round(load, 2) for load in os.getloadavg()],
    }
    write_entries(_path(), entries)


def _read() -> dict[str, Any]:
    return read_entries(_path())


def _path() -> Path:
    return data_dir() / FILE_NAME
