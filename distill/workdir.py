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
folder that `specq draft train` wrote: one with its marker, DIR/.specq-draft/run.json, which every
version has written first, before anything else goes into DIR (an empty folder is used as it is). A
model folder of another origin (the target's, a downloaded draft) is never deleted, nor a symbolic
link or what it points to.

Whatever `--overwrite` says, a DIR is refused before anything is touched where writing or deleting it
could reach what the run reads or specq keeps (`check_output_place`): a DIR that is, holds or lies
inside the target's folder or specq's data directory, or that holds the data file or a GGUF target
file (is the folder they are in, or one above it). A new folder beside the data file is fine.
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
    made_root: bool = False  # this try made DIR (it was not there, or --overwrite removed it)

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

    def discard(self) -> None:
        """Undo a new run refused before its work (`--time-limit` too short): its work folder, and DIR
        where this try made it, so that the next command finds DIR as it was (or finds none)."""
        shutil.rmtree(self.work)
        if self.made_root and not any(self.root.iterdir()):
            self.root.rmdir()

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


def written_by_draft_train(root: Path) -> bool:
    """Whether `root` carries the marker of a folder `specq draft train` wrote: a run file it can read, in
    a work folder that is no symbolic link (lstat: a link could make any folder look like one)."""
    work, run_file = root / WORK, root / WORK / RUN_FILE
    if work.is_symlink() or run_file.is_symlink() or not run_file.is_file():
        return False
    return _read_run(root) is not None


def check_output_place(root: Path, target: str, data: str | None) -> None:
    """OutputPathError where DIR is, holds or lies inside the target's folder or specq's data directory,
    or holds the data file or a GGUF target file (is their folder or one above it); `data` None: read
    from standard input. Paths compare resolved (symbolic links, `..`), so no spelling slips past."""
    from specq.paths import data_dir

    place = _resolved(root)
    kept_folders = [("specq's data directory", data_dir())]
    kept_files = [] if data is None else [("the data file", Path(data))]
    if Path(target).is_dir():
        kept_folders.append(("the target's folder", Path(target)))
    elif Path(target).is_file():
        kept_files.append(("the target", Path(target)))
    for what, folder in kept_folders:
        kept = _resolved(folder)
        relation = _relation(place, kept)
        if relation is not None:
            raise OutputPathError(f"-o {root} {relation} {what} ({kept}); give a DIR of its own")
    for what, file in kept_files:
        kept = _resolved(file)
        if place in kept.parents:
            raise OutputPathError(f"-o {root} holds {what} ({kept}); give a DIR of its own (a new folder beside it)")


def _relation(place: Path, kept: Path) -> str | None:
    """How DIR stands to a folder it must keep clear of, in words; None: apart."""
    if place == kept:
        return "is"
    if kept in place.parents:
        return "lies inside"
    if place in kept.parents:
        return "holds"
    return None


def _resolved(path: Path) -> Path:
    return Path(os.path.realpath(path))


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
            _remove_for_overwrite(root)
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
    made_root = not resumed and not root.exists()
    if not resumed:
        (root / WORK).mkdir(parents=True)
    with _locked(root):
        run = _read_run(root) if resumed else None
        workdir = WorkDir(root, run or {"version": VERSION, **expected}, resumed, made_root)
        if not resumed:
            workdir.advance("decode")
        yield workdir


def _remove_for_overwrite(root: Path) -> None:
    """`--overwrite`: an empty folder is kept to write into; a folder `specq draft train` wrote is deleted
    (under its lock, so never while a run works in it); anything else is refused, untouched."""
    if root.is_symlink():  # deleting would remove the link's target's files, or fail half-way
        raise OutputPathError(f"{root} is a symbolic link; --overwrite takes only a real folder, named itself")
    if not any(root.iterdir()):
        return
    if not written_by_draft_train(root):
        raise OutputPathError(
            f"{root} is not a folder `specq draft train` wrote (no {WORK}/{RUN_FILE}): --overwrite deletes only "
            "those; choose another DIR"
        )
    with _locked(root):
        shutil.rmtree(root)


@contextmanager
def _locked(root: Path) -> Iterator[None]:
    (root / WORK).mkdir(parents=True, exist_ok=True)
    with open(root / WORK / "lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputPathError(f"another `specq draft train` is working in {root}") from None
        yield
