"""What compiling a model measured on this machine, kept so that `--compile auto` on a CPU compiles
only where it paid.

On a GPU a compiled forward always pays: an eager step is launch-bound. On a CPU the gain depends on
the model's size and on the CPU itself: the same 2.75M-parameter draft's forward ran 1.49x faster
compiled on one 2-core VM and 1.16x on another (docs/benchmarks.md). So every compile times a decode
step through the compiled and the eager forward (decoding/compiled.py) and keeps the ratio here, under
a key of what decides it: the model's config (its shape, not its weights or where it was loaded from),
its dtype and device, the compiler backend, the CPU, torch's version and its thread count. A model of
another config, a new torch or another machine is measured afresh.

One JSON file in specq's data directory, next to inductor's compiled artefacts. It is replaced whole
(os.replace), so a reader never sees half of it; two processes recording at once may lose one entry,
which the next compile of that model measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import torch

from specq.decoding.hf_model import CausalLM
from specq.paths import data_dir

log = logging.getLogger(__name__)

FILE_NAME = "compile-speedups.json"


def speedup_key(model: CausalLM, backend: str) -> str:
    """What a compiled forward's speedup depends on, hashed."""
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
    }
    return hashlib.sha256(json.dumps(decides, sort_keys=True, default=str).encode()).hexdigest()[:32]


def recorded_speedup(key: str) -> float | None:
    """The last speedup measured for `key` on this machine, or None."""
    entry = _read().get(key)
    return float(entry["speedup"]) if isinstance(entry, dict) and "speedup" in entry else None


def record_speedup(key: str, model_name: str, speedup: float) -> None:
    entries = _read()
    entries[key] = {
        "model": Path(model_name).name,  # for whoever reads the file; the key is what counts
        "speedup": round(speedup, 4),
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    path = _path()
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(partial, path)
    except OSError as exc:  # a read-only data directory costs the record, never the job
        log.warning("cannot keep the compiled speedup in %s: %s", path.name, exc)
        partial.unlink(missing_ok=True)


def _read() -> dict[str, Any]:
    try:
        entries = json.loads(_path().read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # damaged: measured afresh, never a failed load
        log.warning("ignoring %s: %s", FILE_NAME, exc)
        return {}
    return entries if isinstance(entries, dict) else {}


def _path() -> Path:
    return data_dir() / FILE_NAME


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_name()} x{os.cpu_count()}"


@cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:  # Linux: platform.processor() is often empty there
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
