"""The worker context of this process, set once by `specq worker` (or by an in-process `submit`)."""

from __future__ import annotations

import os
import socket

from specq.worker.context import WorkerContext

_context: WorkerContext | None = None


def set_context(ctx: WorkerContext | None) -> None:
    global _context
    _context = ctx


def get_context_or_none() -> WorkerContext | None:
    return _context


def get_context() -> WorkerContext:
    if _context is None:
        raise RuntimeError("no worker context: start workers with `specq worker`")
    return _context


def worker_name(device: str, kind: str = "worker") -> str:
    """Unique among live workers: a restarted worker is a new name, so it never takes over a dead one's
    leases before they expire."""
    return f"{kind}@{socket.gethostname()}:{device}:{os.getpid()}"
