"""Submit's model check: the target and the draft load (tokenizers and configs, not weights), belong to
families specq supports, and share a vocabulary, so that a typo in a path or an unsupported model
fails the submit, not every chunk on the workers.

Importing transformers (and torch with it) to load two tokenizers costs 3-5 s, most of what a small
submit costs. So the check runs in a child process while the file is read, and a pair of local folders
that passed is remembered in specq's data directory: the next submit of the same folders skips the
check. A folder is known by its resolved path and the name, size and modification time of each file in
it (a GGUF file by its own), so a folder whose files changed is checked again, as is every pair after
an upgrade of transformers or tokenizers or a change of what the check checks. Hub ids are checked
every time (what they resolve to can change upstream).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import TypeVar

from specq.paths import data_dir

log = logging.getLogger(__name__)

PASSED_FILE = "checked-models.json"
PASSED_KEPT = 256  # pairs remembered, the most recent
LOADERS = ("transformers", "tokenizers")
# What the check checks: a pair that passed an older revision is checked again (2: supported families;
# 3: whether the target has a chat template; 4: draft heads, by load_pair's own rule).
CHECK_REVISION = 4

T = TypeVar("T")


def check_models(target: str, draft: str | None) -> None:
    """What a load checks before the weights (models/loading.py check_pair: the tokenizers, the configs,
    a draft head's every field); ModelLoadError if they are missing, if the vocabularies differ, if a
    model's family is not supported (models/families.py) or a draft head does not fit the target."""
    from specq.models.loading import check_pair

    check_pair(target, draft)


# -- pairs that passed ----------------------------------------------------------------------------------
def _folder_identity(name: str) -> list | None:
    """What a local model folder (or GGUF file) is, as far as the check is concerned; None for a hub id."""
    path = Path(name)
    if path.is_file():
        stat = path.stat()
        return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]
    if not path.is_dir():
        return None
    files = []
    for entry in os.scandir(path):
        if entry.is_file():
            stat = entry.stat()
            files.append((entry.name, stat.st_size, stat.st_mtime_ns))
    return [str(path.resolve()), sorted(files)]


def _loader_versions() -> list[str | None]:
    """The libraries that load the folders: an upgrade may read them differently, so it checks again."""
    from importlib.metadata import PackageNotFoundError, version

    versions: list[str | None] = []
    for package in LOADERS:
        try:
            versions.append(version(package))
        except PackageNotFoundError:
            versions.append(None)
    return versions


def _pair_key(target: str, draft: str | None) -> str | None:
    """A digest of both folders' identities and the loaders' versions; None when either model is a hub id."""
    identities = [_folder_identity(target), None if draft is None else _folder_identity(draft)]
    if identities[0] is None or (draft is not None and identities[1] is None):
        return None
    return hashlib.sha256(json.dumps([*identities, _loader_versions(), CHECK_REVISION]).encode()).hexdigest()


def _passed() -> dict[str, bool]:
    """The pairs that passed, oldest first: pair key -> True (a pass written before chat lines were
    rendered at submit holds whether the target had a chat template instead: a pass all the same)."""
    try:
        passed = json.loads((data_dir() / PASSED_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: check again, and rewrite it
    if not isinstance(passed, dict):
        return {}  # an older revision's list: its pairs are checked again anyway
    return {k: v for k, v in passed.items() if isinstance(v, bool)}


def passed_before(target: str, draft: str | None) -> bool:
    """Whether these very folders passed the check before."""
    key = _pair_key(target, draft)
    return key is not None and key in _passed()


def remember_passed(target: str, draft: str | None) -> None:
    key = _pair_key(target, draft)
    if key is None:
        return
    kept = [(k, v) for k, v in _passed().items() if k != key][-(PASSED_KEPT - 1) :]
    passed = dict([*kept, (key, True)])
    try:  # replaced whole: a concurrent submit reads the old list or the new one, never half of one
        path = data_dir() / PASSED_FILE
        scratch = path.with_name(f"{path.name}.{os.getpid()}")
        scratch.write_text(json.dumps(passed), encoding="utf-8")
        os.replace(scratch, path)
    except OSError as exc:  # a read-only home costs the next submit a check, nothing more
        log.debug("cannot remember the model check: %s", exc)


# -- the check beside the read --------------------------------------------------------------------------
class ModelCheck:
    """`check_models`, unless these folders passed before, in a child process while the caller reads
    the file (in this process if transformers is already imported). A context manager: on the way out
    of a failure, a failed check is raised in its place (a model that cannot be loaded is the first
    thing to fix)."""

    POLL_EVERY = 8192  # lines between looks at the child

    def __init__(self, target: str, draft: str | None, skip: bool = False) -> None:
        self.target, self.draft = target, draft
        self._pool: ProcessPoolExecutor | None = None
        self._future: Future | None = None
        self._pending = not skip and not passed_before(target, draft)
        if not self._pending:
            return
        if "transformers" in sys.modules:
            # already imported (an application calling this, the tests): the check is quick here, and a
            # child would have to import it all again
            check_models(target, draft)
            self._pass()
            return
        # spawn: the child needs none of this process's state, and a fork of a process that may hold
        # torch's thread pools is not safe
        self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self._future = self._pool.submit(check_models, target, draft)

    def __enter__(self) -> ModelCheck:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        try:
            if isinstance(exc, Exception):
                self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)

    def _pass(self) -> None:
        self._pending = False
        remember_passed(self.target, self.draft)

    def raise_if_failed(self) -> None:
        """Raise the check's ModelLoadError if it has already failed; never waits."""
        if self._future is not None and self._future.done() and self._future.exception() is not None:
            self.wait()

    def wait(self) -> None:
        """Block until the check ends; raise its ModelLoadError."""
        if self._future is not None and self._pending:
            self._future.result()
            self._pass()

    def watch(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, raising the check's error as soon as it is known."""
        for count, item in enumerate(items, start=1):
            if count % self.POLL_EVERY == 0:
                self.raise_if_failed()
            yield item
