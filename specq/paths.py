"""Where specq keeps its own files (the embedded database, the demo models, converted GGUF models)."""

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import platformdirs

from specq.speaking import EVERY_S

LOCK_POLL_S = 0.5  # how often a process waiting on another's lock tries it again


def data_dir() -> Path:
    """specq's data directory: `SPECQ_HOME` if set, else the platform's user data dir."""
    root = os.environ.get("SPECQ_HOME") or platformdirs.user_data_dir("specq", appauthor=False)
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def file_lock(
    path: Path,
    say: Callable[[str], None] | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    every_s: float = EVERY_S,
) -> Iterator[None]:
    """An exclusive fcntl lock on `path`, held for the block; other builders wait for it. The holder writes
    its pid into the file, so that a process that finds the lock held says, through `say`, what it waits
    for and on whom: at once, then every `every_s` seconds (a build can hold it for minutes)."""
    with open(path, "a+") as handle:
        if say is None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        else:
            _wait_saying(handle, path, say, clock, sleep, every_s)
        _write_holder(handle)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _wait_saying(
    handle: IO[str],
    path: Path,
    say: Callable[[str], None],
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    every_s: float,
) -> None:
    started, said_at = clock(), None
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = clock()
        if said_at is None or now - said_at >= every_s:
            say(f"waiting for {path}, held by {_holder(handle)} ({now - started:.0f}s so far)")
            said_at = now
        sleep(LOCK_POLL_S)


def _write_holder(handle: IO[str]) -> None:
    with contextlib.suppress(OSError):  # a lock file it cannot write still locks; waiters just cannot name it
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()


def _holder(handle: IO[str]) -> str:
    """`pid N` as the holder wrote it, else `another process` (one that has not written it yet, or an
    older specq's)."""
    with contextlib.suppress(OSError, ValueError):
        handle.seek(0)
        return f"pid {int(handle.read().strip())}"
    return "another process"
