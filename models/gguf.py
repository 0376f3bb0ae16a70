"""GGUF files as models: a `.gguf` file (or a folder holding one) where a model folder is expected.

transformers reads a GGUF file's weights, tokenizer and chat template (`from_pretrained(folder,
gguf_file=NAME)`, with the `gguf` and `accelerate` packages) and dequantizes the weights, which takes
from seconds to minutes (a large vocabulary's tokenizer is most of it). So a file is converted once
into an ordinary model folder (safetensors, the tokenizer with its chat template) in specq's data
directory, keyed by the file's SHA-256, and every later load, a worker's restart included, reads that
folder. The conversion runs under a lock into a temporary folder renamed into place at the end, so
concurrent loaders wait for one another and a killed conversion leaves nothing that looks complete.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

from specq.errors import ModelLoadError, reason
from specq.paths import data_dir, file_lock

logger = logging.getLogger(__name__)

SUFFIX = ".gguf"
CACHE_DIR = "gguf-models"
# What a converted folder holds: a folder converted by an older revision is converted again.
REVISION = 1
DONE_FILE = "specq-gguf.txt"  # written last: the folder is complete
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


def resolve(name: str) -> str:
    """What transformers loads for the model name `name`: the converted folder of a GGUF file
    (converting it on first use), else `name` unchanged."""
    path = gguf_file(name)
    return name if path is None else str(converted_folder(path))


def converted_folder(path: Path) -> Path:
    """The dequantized model folder of the GGUF file `path`, converted now unless it already was."""
    stat = path.stat()
    folder = data_dir() / CACHE_DIR / f"{_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)}-r{REVISION}"
    if (folder / DONE_FILE).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(folder.parent / f".{folder.name}.lock"):
        if (folder / DONE_FILE).exists():  # another process converted it while this one waited
            return folder
        for stale in folder.parent.glob(f".{folder.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed conversion; the lock says none runs
        work = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            _convert(path, work)
            (work / DONE_FILE).write_text(f"{path.resolve()}\n", encoding="utf-8")
            work.chmod(0o755)  # mkdtemp made it private; the finished folder is an ordinary one
            shutil.rmtree(folder, ignore_errors=True)  # a half-written one from before this lock existed
            work.rename(folder)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return folder


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


def _convert(path: Path, into: Path) -> None:
    """Dequantize the GGUF file `path` to fp32 and save it with its tokenizer as a model folder `into`."""
    _require_extra(path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    logger.info("converting the GGUF file %s (once; later loads read the converted folder)", path)
    # transformers' own per-tensor bar would interleave with specq's progress bar on stderr
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        # dequantize: plain dense weights, which the engine's forwards and compiled graphs expect (packed
        # GGUF blocks need kernels that not every device has); fp32 keeps every dequantized value exact
        model = AutoModelForCausalLM.from_pretrained(
            path.parent,
            gguf_file=path.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)  # a dense model now, saved as one
        model.save_pretrained(into)
        tokenizer.save_pretrained(into)
    except Exception as exc:  # a truncated file, an architecture transformers cannot read, ...
        raise ModelLoadError(f"cannot load the GGUF file {str(path)!r} ({reason(exc)})") from exc
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
