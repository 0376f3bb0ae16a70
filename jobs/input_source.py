"""The input of `run` and `submit` as a file that can be read twice.

Validation reads the input whole before anything is generated or committed, and the run or the store
reads it again (submit's one read also rereads lines whose id hash repeats). Standard input (`-`), a
FIFO, `/dev/stdin` on a pipe or a process substitution can be read only once, so such an input is
copied once to a temporary file (a spool), removed at the end; a regular file is read in place. An
input over the size limit is refused as soon as the spool passes it.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO

from specq.errors import BadInputError
from specq.jobs.inputs import MAX_INPUT_ENV, InputLimits

STDIN = "-"
STDIN_NAME = "<stdin>"  # how reports name standard input (INPUT in `INPUT:LINE: ...`)
SPOOL_CHUNK = 1 << 20


@dataclass(frozen=True)
class InputSource:
    path: str  # a regular file, which may be read any number of times
    name: str  # the input as the user gave it, for messages and the stored job


def _copy(source: IO[bytes], spool: IO[bytes], limit: int, name: str) -> None:
    """Copy all of `source`, or refuse it as soon as it is over `limit` bytes (its rest is never read)."""
    remaining = limit + 1
    while remaining > 0 and (chunk := source.read(min(SPOOL_CHUNK, remaining))):
        spool.write(chunk)
        remaining -= len(chunk)
    if remaining == 0:
        reason = f"the input is over the limit of {limit} bytes (raise it with --max-input-bytes or {MAX_INPUT_ENV})"
        raise BadInputError([f"{name}: {reason}"])
    spool.flush()


@contextmanager
def readable_input(path: str, limits: InputLimits | None = None) -> Iterator[InputSource]:
    """`path` ("-": standard input) as an InputSource whose `path` can be read again."""
    if path != STDIN and stat.S_ISREG(os.stat(path).st_mode):
        yield InputSource(path, path)
        return
    limit = (limits or InputLimits.from_env()).max_file_bytes
    with tempfile.NamedTemporaryFile(prefix="specq-input-", suffix=".jsonl") as spool:
        name = STDIN_NAME if path == STDIN else path
        if path == STDIN:
            if sys.stdin is None:  # started with its standard input closed
                raise BadInputError([f"{name}: standard input is closed"])
            _copy(sys.stdin.buffer, spool, limit, name)
        else:
            with open(path, "rb") as source:
                _copy(source, spool, limit, name)
        yield InputSource(spool.name, name)
