"""The output folder of `specq draft train`, and the work state that lets a run resume.

    DIR/                     the draft as a Hugging Face folder (config, weights, the target's tokenizer),
                             written once training ends: what `--draft DIR` loads
    DIR/.specq-draft/
        run.json             the settings, the data's digest, the phase reached (decode, train, evaluate,
                             done) and, at the end, the held-out measurement
        decoding.jsonl       the completions decoded so far, one line each, appended as the target finishes
                             them (removed once sequences.jsonl is written): a rerun decodes only the rest
        sequences.jsonl      the target's completions of the training prompts, in their order (written whole)
        hidden-states.pt     a head run's target hidden states (distill/head.py), read once (removed when
                             the run is done)
        checkpoint.pt        the latest training checkpoint (removed when the run is done)
        lock                 held while a run works in DIR, so two runs never write into one folder

A DIR that exists is refused, unless it holds an unfinished run with the same settings (which then
resumes from its last phase and checkpoint) or `--overwrite` is given. `--overwrite` deletes only a
folder that is empty, a model folder (config.json) or a run's: never a folder of other files named
by mistake.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specq.errors import OutputPathError

WORK = ".specq-draft"
RUN_FILE = "run.json"
DECODING = "decoding.jsonl"
SEQUENCES = "sequences.jsonl"
HIDDEN_STATES = "hidden-states.pt"
CHECKPOINT = "checkpoint.pt"
PHASES = ("decode", "train", "evaluate", "done")
VERSION = 1


def file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        for chunk in iter(lambda: data.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class WorkDir:
    root: Path  # DIR
    run: dict[str, Any]  # run.json's content
    resumed: bool  # an interrupted run's folder, continued

    @property
    def work(self) -> Path:
        return self.root / WORK

    @property
    def phase(self) -> str:
        return str(self.run["phase"])

    @property
    def decoding(self) -> Path:
        return self.work / DECODING

    @property
    def sequences(self) -> Path:
        return self.work / SEQUENCES

    @property
    def hidden_states(self) -> Path:
        return self.work / HIDDEN_STATES

    def remove_work_files(self) -> None:
        """The stored decode, the hidden states and the checkpoint: a finished run needs none of them."""
        for name in (DECODING, HIDDEN_STATES, CHECKPOINT):
            (self.work / name).unlink(missing_ok=True)

    def advance(self, phase: str, **fields: Any) -> None:
        """Record that `phase` is reached (with `fields`), written then renamed into place."""
        assert phase in PHASES
        self.run.update(fields, phase=phase)
        partial = self.work / (RUN_FILE + ".partial")
        partial.write_text(json.dumps(self.run, indent=2) + "\n", encoding="utf-8")
        os.replace(partial, self.work / RUN_FILE)


def _read_run(root: Path) -> dict[str, Any] | None:
    try:
        run = json.loads((root / WORK / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return run if isinstance(run, dict) and run.get("version") == VERSION and run.get("phase") in PHASES else None


def _deletable(root: Path) -> bool:
    entries = {entry.name for entry in root.iterdir()}
    return not entries or WORK in entries or "config.json" in entries


@contextmanager
def open_workdir(root: Path, identity: dict[str, Any], data_digest: str, overwrite: bool) -> Iterator[WorkDir]:
    """DIR ready for this run, held locked: new, replaced (`overwrite`) or an unfinished run's with
    the same settings; OutputPathError (a usage error) for any other DIR that exists."""
    expected = {"settings": identity, "data_sha256": data_digest}
    resumed = False
    if root.exists() or root.is_symlink():
        if not root.is_dir():
            raise OutputPathError(f"{root} exists and is not a folder")
        previous = _read_run(root)
        if overwrite:
            if not _deletable(root):
                raise OutputPathError(
                    f"{root} holds files that are neither a model nor a draft run; --overwrite deletes only those: "
                    "choose another DIR"
                )
            with _locked(root):
                shutil.rmtree(root)
        elif previous is None or previous["phase"] == "done":
            raise OutputPathError(f"{root} exists; give another DIR, or --overwrite to replace it")
        else:
            differing = sorted(
                key
                for key in {**previous.get("settings", {}), **identity}
                if previous.get("settings", {}).get(key) != identity.get(key)
            )
            if previous.get("data_sha256") != data_digest:
                differing.append("the data file's content")
            if differing:
                raise OutputPathError(
                    f"{root} holds an unfinished run with other settings ({', '.join(differing)}); rerun it with "
                    "the same ones to resume, or give --overwrite to start over"
                )
            resumed = True
    if not resumed:
        (root / WORK).mkdir(parents=True)
    with _locked(root):
        run = _read_run(root) if resumed else None
        workdir = WorkDir(root, run or {"version": VERSION, **expected}, resumed)
        if not resumed:
            workdir.advance("decode")
        yield workdir


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    (root / WORK).mkdir(parents=True, exist_ok=True)
    with open(root / WORK / "lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputPathError(f"another `specq draft train` is working in {root}") from None
        yield
