"""What this machine measured once and keeps for later runs: small JSON files of entries by key in
specq's data directory (a model's compiled speedup, its bf16 speedup on this CPU), and the name of
the CPU those keys include. A damaged or unwritable file costs a new measurement, never a run."""

from __future__ import annotations

import json
import logging
import os
import platform
from functools import cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def read_entries(path: Path) -> dict[str, Any]:
    """The file's entries; {} where it is missing or damaged (then measured afresh)."""
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path.name, exc)
        return {}
    return entries if isinstance(entries, dict) else {}


def write_entries(path: Path, entries: dict[str, Any]) -> None:
    """Replace the file with `entries` at once (written aside, then renamed: a reader never sees half)."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(partial, path)
    except OSError as exc:  # a read-only data directory: measured again next time
        log.warning("cannot keep the measurement in %s: %s", path.name, exc)
        partial.unlink(missing_ok=True)


@cache
def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"
