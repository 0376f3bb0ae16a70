"""Where `specq run -o` and `specq export -o` write: whole files, and only what the path names.

- A regular file (or a new one) is written under a temporary name in its folder and renamed over it
  when complete: a reader never sees half a file, and a failed run leaves the old one as it was.
- A symbolic link is followed: its target is what gets (atomically) replaced; the link itself stays.
- Anything else that exists, a FIFO, a character device (`/dev/null`) or `/dev/stdout`, is written
  through, as `>` in a shell would: renaming a temporary file over it would swap the node for a
  regular file (as root, `-o /dev/null` would have replaced the real device).
- `-` is standard output.

A path that cannot be written (a missing folder, no permission, a folder) is an `OutputPathError`,
raised before anything is written; a write that fails on the way (a full disk) is a `SpecqError`.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from specq.errors import OutputPathError, SpecqError


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _new_file_mode(existing: os.stat_result | None) -> int:
    """The mode of the file the rename puts in place: the replaced file's, else what `open` would give."""
    if existing is not None:
        return stat.S_IMODE(existing.st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask  # mkstemp's 0600 would outlive the rename


@contextmanager
def open_output(path: str) -> Iterator[IO[str]]:
    """`path` opened for UTF-8 text (newline="" so the CSV writer's CRLF is kept), written as the module
    docstring says; the file is in place only once the block has ended without an exception."""
    if path == "-":
        if sys.stdout is None:  # started with its standard output closed
            raise OutputPathError("cannot write to standard output: it is closed")
        try:
            with _write_errors("standard output"):
                yield sys.stdout
                sys.stdout.flush()
        except SpecqError:
            # what could not be written would be flushed again at exit, with a second error: drop it
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            raise
        return
    try:
        existing: os.stat_result | None = os.stat(path)  # follows links
    except FileNotFoundError:
        existing = None
    except OSError as exc:
        raise OutputPathError(f"cannot write {path}: {_reason(exc)}") from None
    if existing is not None and stat.S_ISDIR(existing.st_mode):
        raise OutputPathError(f"cannot write {path}: it is a folder")
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        try:
            out = open(path, "w", encoding="utf-8", newline="")  # noqa: SIM115
        except OSError as exc:
            raise OutputPathError(f"cannot write {path}: {_reason(exc)}") from None
        with _write_errors(path), out:
            yield out
        return
    final = os.path.realpath(path)  # a link's target, so the link itself stays a link
    folder = os.path.dirname(final)
    if not os.path.isdir(folder):
        raise OutputPathError(f"cannot write {path}: the folder {os.path.dirname(path) or '.'} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".specq-", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise OutputPathError(f"cannot write {path}: {_reason(exc)}") from None
    try:
        os.chmod(tmp, _new_file_mode(existing))
        with _write_errors(path), open(fd, "w", encoding="utf-8", newline="") as out:
            yield out
        with _write_errors(path):
            os.replace(tmp, final)
    except BaseException:
        os.unlink(tmp)
        raise


@contextmanager
def _write_errors(path: str) -> Iterator[None]:
    """An OSError while writing (a full disk, a reader that went away) as one sentence naming `path`."""
    try:
        yield
    except OSError as exc:
        raise SpecqError(f"cannot write {path}: {_reason(exc)}") from None
