"""Where specq keeps its own files (the embedded database, the demo models, converted GGUF models)."""

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import platformdirs


def data_dir() -> Path:
    """specq's data directory: `SPECQ_HOME` if set, else the platform's user data dir."""
    root = os.environ.get("SPECQ_HOME") or platformdirs.user_data_dir("specq", appauthor=False)
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive fcntl lock on `path`, held for the block; other builders wait for it."""
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
