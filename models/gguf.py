"""GGUF files as models: a `.gguf` file (or a folder holding one) where a model folder is expected.

transformers reads a GGUF file's weights, tokenizer and chat template (`from_pretrained(folder,
gguf_file=NAME)`, with the `gguf` and `accelerate` packages) and dequantizes the weights, which takes
from seconds to minutes (a large vocabulary's tokenizer is most of it). So a file is converted once
into an ordinary model folder (safetensors, the tokenizer with its chat template) in specq's data
directory, keyed by the file's SHA-256, and every later load, a worker's restart included, reads that
folder. The conversion runs under a lock into a temporary folder renamed into place at the end, so
concurrent loaders wait for one another and a killed conversion leaves nothing that looks complete (its
temporary folder is removed by the next conversion of any file).

Before a file is converted, its header is walked with bounded reads (models/gguf_header.py), so a file
that declares millions of tensors, or lengths past its end, is refused before a reader builds anything.
A converted folder records each file's size and a digest of it (the whole of a small file, samples of a
large one: checking must not cost what converting does); a load that finds them changed (a file cut
short, deleted or overwritten) converts the file again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from specq.errors import ModelLoadError, reason
from specq.models.gguf_header import check_header
from specq.paths import data_dir, file_lock

logger = logging.getLogger(__name__)

SUFFIX = ".gguf"
CACHE_DIR = "gguf-models"
# What a converted folder holds: a folder converted by an older revision is converted again.
REVISION = 1
DONE_FILE = "specq-gguf.txt"  # written last: the folder is complete; its record of the files (JSON)
WHOLE_FILE_BYTES = 8 << 20  # a converted file up to this size is hashed whole, a larger one in samples
SAMPLES, SAMPLE_BYTES = 16, 256 << 10  # spread over the file, its first and last bytes among them
EXTRA_PACKAGES = ("gguf", "accelerate")
INSTALL_HINT = "pip install 'specq[gguf]'"


def gguf_file(name: str) -> Path | None:
    """The GGUF file that the model name `name` means: `name` itself when it ends in `.gguf`, the one
    `.gguf` file of a folder that is no model folder (holds no config.json); None for anything else (a
    model folder, a Hugging Face id). ModelLoadError, one line, for a `.gguf` path that is not a file
    and for a folder holding several."""
    path = Path(name)
    if path.suffix.lower() == SUFFIX:
        if not path.is_file():
            raise ModelLoadError(f"the GGUF file {name!r} does not exist")
        return path
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    if len(found) > 1:
        raise ModelLoadError(
            f"the folder {name!r} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:3])}"
            f"{', ...' if len(found) > 3 else ''}); name the one to load"
        )
    return found[0] if found else None


def resolve(name: str, dtype: str | None = None) -> str:
    """What transformers loads for the model name `name`: the converted folder of a GGUF file in `dtype`
    (converting it on first use; None: `converted_folder`'s choice), else `name` unchanged."""
    path = gguf_file(name)
    return name if path is None else str(converted_folder(path, dtype))


# dtypes a file is converted in; fp32's folder keeps the name it had before conversions had a dtype
DTYPES = ("float32", "bfloat16", "float16")


def converted_folder(path: Path, dtype: str | None = None) -> Path:
    """The dequantized model folder of the GGUF file `path` with its weights saved in `dtype` (a torch
    dtype's name), converted now unless it already was. None, for a caller that reads only the tokenizer
    or the config (the same in every dtype): a finished conversion in any dtype, else fp32's."""
    if dtype is None:
        finished = [folder for folder in (_folder_of(path, each) for each in DTYPES) if _damage(folder) is None]
        return finished[0] if finished else converted_folder(path, DTYPES[0])
    if dtype not in DTYPES:
        raise ModelLoadError(f"cannot convert the GGUF file {str(path)!r} to {dtype}; use one of {', '.join(DTYPES)}")
    folder = _folder_of(path, dtype)
    if _damage(folder) is None:
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(_lock_file(folder), logger.warning):  # another process converting it: say so, and whose
        damage = _damage(folder)
        if damage is None:  # another process converted it while this one waited
            return folder
        if damage == UNRECORDED:  # converted before folders recorded their files: trusted once
            with contextlib.suppress(OSError):  # unwritable: it stays unrecorded, and loads as before
                _record_files(folder, path)
            return folder
        if damage != NOT_CONVERTED:
            logger.warning("the converted folder %s is damaged (%s); converting the GGUF file again", folder, damage)
        _require_extra(path)
        check_header(path)
        _remove_abandoned_work(folder)
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            _convert(path, work, dtype)
            _record_files(work, path)
            work.chmod(0o755)  # mkdtemp made it private; the finished folder is an ordinary one
            shutil.rmtree(folder, ignore_errors=True)  # damaged, or half-written before this lock existed
            _move_into_place(work, folder)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return folder


def _folder_of(path: Path, dtype: str) -> Path:
    stat = path.stat()
    name = f"{_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)}-r{REVISION}"
    return data_dir() / CACHE_DIR / (name if dtype == DTYPES[0] else f"{name}-{dtype}")


def _lock_file(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lock"


def _move_into_place(work: Path, folder: Path) -> None:
    try:
        work.rename(folder)
    except OSError as exc:  # the damaged folder could not be removed (its files are someone else's)
        raise ModelLoadError(
            f"cannot replace the converted folder {str(folder)!r} ({exc.strerror or exc}): remove it, and it is "
            "converted again"
        ) from None


def _remove_abandoned_work(folder: Path) -> None:
    """Remove the temporary folders of killed conversions, of any file (this process holds the lock of
    `folder`'s): one whose lock no process holds is no conversion's that runs (a conversion holds its lock
    until its folder is in place)."""
    cache = folder.parent
    for work in cache.glob(".*.tmp-*"):
        name = work.name[1:].rsplit(".tmp-", 1)[0]
        if name == folder.name:
            shutil.rmtree(work, ignore_errors=True)
            continue
        with _lock_if_free(cache / f".{name}.lock") as free:
            if free:
                shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def _lock_if_free(path: Path) -> Iterator[bool]:
    """The lock at `path` held for the block if no process holds it; False (not waiting) if one does."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# -- the record of a converted folder's files -------------------------------------------------------------
NOT_CONVERTED = "not converted"
UNRECORDED = "no record of its files"


def _damage(folder: Path) -> str | None:
    """None if the converted folder is there and its files are those recorded at its conversion, else
    what is wrong (NOT_CONVERTED, UNRECORDED for a folder converted before records were kept, or the
    first file that differs)."""
    try:
        text = (folder / DONE_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return NOT_CONVERTED
    except (OSError, UnicodeDecodeError) as exc:
        return f"its record is unreadable: {exc}"
    if not text.startswith("{"):
        return UNRECORDED  # an older record: the source's path alone
    try:
        files = json.loads(text)["files"]
        recorded = {str(name): (int(size), str(digest)) for name, (size, digest) in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its record is unreadable: {type(exc).__name__}"
    for name, (size, digest) in recorded.items():
        damage = _file_damage(folder / name, size, digest)
        if damage is not None:
            return f"{name}: {damage}"
    return None


def _file_damage(path: Path, size: int, digest: str) -> str | None:
    try:
        actual = path.stat().st_size
        if actual != size:
            return f"{actual} bytes, not the {size} converted"
        if _sampled_sha256(path, size) != digest:
            return "its content changed"
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _record_files(folder: Path, source: Path) -> None:
    """Write the record (the last file written: its presence says the folder is complete)."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != DONE_FILE):
        size = path.stat().st_size
        files[path.relative_to(folder).as_posix()] = [size, _sampled_sha256(path, size)]
    record = {"source": str(source.resolve()), "files": files}
    (folder / DONE_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def _sampled_sha256(path: Path, size: int) -> str:
    """SHA-256 of the whole file up to WHOLE_FILE_BYTES; past that, of SAMPLES blocks spread over it."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if size <= WHOLE_FILE_BYTES:
            while block := handle.read(1 << 20):
                digest.update(block)
            return digest.hexdigest()
        step = (size - SAMPLE_BYTES) // (SAMPLES - 1)
        for index in range(SAMPLES):
            handle.seek(index * step)
            digest.update(handle.read(SAMPLE_BYTES))
    return digest.hexdigest()


# Hashing a few hundred MB takes about a second; a process that loads the same file twice (its tokenizer,
# config and weights) hashes it once, and a file that changed on disk (size or time) is hashed again.
@lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _require_extra(path: Path) -> None:
    missing = []
    for name in EXTRA_PACKAGES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ModelLoadError(f"loading the GGUF file {str(path)!r} needs {' and '.join(missing)}: {INSTALL_HINT}")


def _convert(path: Path, into: Path, dtype: str) -> None:
    """Dequantize the GGUF file `path` to `dtype` (a torch dtype's name) and save it with its tokenizer as
    a model folder `into`: a load in that dtype reads it as saved, not cast from fp32 at every load."""
    _require_extra(path)
    from transformers.utils import logging as hf_logging

    logger.info("converting the GGUF file %s (once; later loads read the converted folder)", path)
    # transformers' own per-tensor bar would interleave with specq's progress bar on stderr
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with _quiet_tensor_bar():
            _convert_quietly(path, into, dtype)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _quiet_tensor_bar() -> Iterator[None]:
    """transformers' GGUF reader draws its "Converting and de-quantizing GGUF tensors..." bar with tqdm
    itself, past its own switch (disable_progress_bar) and past TQDM_DISABLE, which tqdm reads only when
    it is imported: in a log file that is thousands of carriage-return frames. Silenced here, restored
    after."""
    import functools

    from transformers import modeling_gguf_pytorch_utils as reader

    drawn = reader.tqdm
    reader.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        reader.tqdm = drawn


def _convert_quietly(path: Path, into: Path, dtype: str) -> None:
    """`_convert`'s work, its bars silenced by the caller."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        # dequantize: plain dense weights, which the engine's forwards and compiled graphs expect (packed
        # GGUF blocks need kernels that not every device has); fp32 keeps every dequantized value exact,
        # bf16 and fp16 hold them as a load in that dtype would cast them
        model = AutoModelForCausalLM.from_pretrained(
            path.parent,
            gguf_file=path.name,
            dtype=getattr(torch, dtype),
            quantization_config=GgufConfig(dequantize=True),
        )
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)  # a dense model now, saved as one
        model.save_pretrained(into)
        tokenizer.save_pretrained(into)
    except Exception as exc:  # a truncated file, an architecture transformers cannot read, ...
        raise ModelLoadError(f"cannot load the GGUF file {str(path)!r} ({reason(exc)})") from exc


def described(name: str, folder: str) -> str:
    """How a message names the model `name` that loads from `folder` (what `resolve` gave): a GGUF file
    with its converted folder, the one to remove should its conversion be damaged."""
    return repr(name) if folder == name else f"{name!r} (converted into {folder!r})"
