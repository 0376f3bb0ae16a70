"""What the Dockerfile's COPY steps put into the image, emulated without a container engine.

No Docker engine runs here, so the image's files are rebuilt in a folder: the final stage's COPY lines
are read (WORKDIR resolving relative destinations), and each source is copied from the build context as
Docker copies it: `.dockerignore` honoured (moby's patternmatcher: a pattern that matches a folder
leaves out everything in it, a later `!pattern` takes a path back), a folder's contents (not the folder)
copied into the destination, and symbolic links inside a folder copied as links, not followed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


@dataclass(frozen=True)
class Copy:
    """One COPY line: build-context paths and the absolute destination in the image."""

    sources: tuple[str, ...]
    destination: str  # absolute; ends with "/" where the line's did


@dataclass(frozen=True)
class _Pattern:
    regex: re.Pattern[str]
    exclusion: bool  # a `!pattern`: takes matching paths back in


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined, comments dropped."""
    found: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, rest = (pending + line).strip().partition(" ")
        found.append((keyword.upper(), rest.strip()))
        pending = ""
    return found


def _copy_arguments(text: str) -> list[str]:
    """A COPY line's paths: the JSON form or the shell-like form, flags (--chown=..., --link) left out."""
    words = json.loads(text) if text.startswith("[") else shlex.split(text)
    return [word for word in words if not word.startswith("--")]


def dockerfile_copies(dockerfile: Path) -> list[Copy]:
    """The final stage's COPY lines that copy from the build context (not `--from` another stage)."""
    copies: list[Copy] = []
    workdir = PurePosixPath("/")
    for keyword, rest in _instructions(dockerfile):
        if keyword == "FROM":  # a new stage: only the last one is the image
            copies, workdir = [], PurePosixPath("/")
        elif keyword == "WORKDIR":
            workdir = workdir / rest
        elif keyword in ("COPY", "ADD") and "--from=" not in rest:
            *sources, destination = _copy_arguments(rest)
            absolute = str(workdir / destination) + ("/" if destination.endswith("/") else "")
            copies.append(Copy(tuple(sources), absolute))
    return copies


def final_workdir(dockerfile: Path) -> str:
    """The WORKDIR in force at the end of the Dockerfile (where its last `pip install .` ran)."""
    workdir = PurePosixPath("/")
    for keyword, rest in _instructions(dockerfile):
        if keyword == "FROM":
            workdir = PurePosixPath("/")
        elif keyword == "WORKDIR":
            workdir = workdir / rest
    return str(workdir)


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """moby's patternmatcher: `**` any number of folders, `*` and `?` within one path element."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(f"^{out}$")


def dockerignore(context: Path) -> list[_Pattern]:
    path = context / ".dockerignore"
    patterns = []
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        cleaned = os.path.normpath(line.removeprefix("!").strip()).lstrip("/")
        patterns.append(_Pattern(_pattern_regex(cleaned), exclusion))
    return patterns


def ignored(relative: str, patterns: list[_Pattern]) -> bool:
    """Whether the build context leaves out `relative` (a path inside it, "/"-separated)."""
    parts = relative.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]  # its folders, then itself
    matched = False
    for pattern in patterns:
        if pattern.exclusion != matched:  # only a `!` can take back, only a plain pattern can leave out
            continue
        if any(pattern.regex.match(candidate) for candidate in candidates):
            matched = not pattern.exclusion
    return matched


def _place(source: Path, target: Path) -> None:
    """One file or link, as Docker puts it: a link stays a link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_symlink():
        target.symlink_to(os.readlink(source))
    else:
        shutil.copy2(source, target)


def _copy_folder(context: Path, folder: str, target: Path, patterns: list[_Pattern]) -> None:
    """The contents of `folder` (inside the context), less what .dockerignore leaves out, into `target`."""
    target.mkdir(parents=True, exist_ok=True)
    for entry in sorted((context / folder).iterdir()):
        relative = os.path.normpath(f"{folder}/{entry.name}")
        if ignored(relative, patterns):
            continue
        if entry.is_dir() and not entry.is_symlink():
            _copy_folder(context, relative, target / entry.name, patterns)
        else:
            _place(entry, target / entry.name)


def build_image_files(context: Path, dockerfile: Path, image: Path) -> Path:
    """Copy into the folder `image` (the image's /) what the Dockerfile's COPY lines copy; `image`."""
    patterns = dockerignore(context)
    for copy in dockerfile_copies(dockerfile):
        destination = image / copy.destination.lstrip("/")
        into_folder = copy.destination.endswith("/") or len(copy.sources) > 1
        for source in copy.sources:
            relative = os.path.normpath(source)
            if (relative != "." and ignored(relative, patterns)) or not (context / relative).exists():
                raise FileNotFoundError(f"COPY {source}: not in the build context (.dockerignore or missing)")
            if (context / relative).is_dir():
                _copy_folder(context, relative, destination, patterns)
            else:  # a source named on the line is followed, a link or not
                file = destination / Path(relative).name if into_folder else destination
                file.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(context / relative, file)
    return image
