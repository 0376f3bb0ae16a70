"""A `--target`/`--draft` name checked before anything heavy is imported: a newcomer's typo is answered in
a second, in one line that says what is missing, instead of after torch and transformers have loaded (and,
for a Hugging Face id with no hub in reach, after a minute of the hub client's retries).

What a name means, in the order models/names.py resolves it:

- an existing path: a `.gguf` file; a folder holding config.json and tokenizer files, or one `.gguf` file, or
  a draft head (decoding/draft_head.py's marker file, matched by name: that module imports torch);
- a missing path (it ends in `.gguf`, starts with `/`, `.` or `~`, or has more parts than OWNER/NAME): refused;
- a catalogue name (models/catalogue.py), or a bare word close to one (refused as a typo);
- anything else is a Hugging Face id: fine where the local Hugging Face cache holds it, else the hub must be
  in reach. Where it is not, the id is refused with the alternatives that need no hub; where it is not but
  the cache holds the id, this process goes offline (HF_HUB_OFFLINE) so the load reads the cache at once
  instead of retrying the hub first.

Only the standard library and specq's own light modules here (no torch, transformers or huggingface_hub).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

from specq.errors import ModelFetchError, ModelLoadError
from specq.limits import MODEL_FREE
from specq.models import catalogue, gguf, names

logger = logging.getLogger(__name__)

HEAD_MARKER = "specq-head.json"  # decoding/draft_head.py HEAD_CONFIG, by name: importing it imports torch
MODEL_CONFIG = "config.json"
# What AutoTokenizer builds a tokenizer from: a fast tokenizer's file, a SentencePiece model, a BPE or
# WordPiece vocabulary, a tiktoken file. Any one will do; which one the model needs is transformers' call.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
TOKENIZER_SUFFIXES = (".tiktoken",)
# What huggingface_hub takes for a repo id (its validate_repo_id): NAME or OWNER/NAME
_HUB_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]{1,96}$")
DEFAULT_ENDPOINT = "https://huggingface.co"
# A hub that answers does so in well under this; one that does not is better reported now than after the
# hub client's five retries per file (23 s each, a minute for a tokenizer and a config)
PROBE_TIMEOUT_S = 3.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_TRUE = {"1", "on", "yes", "true"}


def check_model_name(name: str, option: str) -> None:
    """ModelLoadError (bad input), one line, where `name` as `option` (--target or --draft) cannot be a model:
    a missing path, a folder that lacks what a model folder holds, a typo of a catalogue name, a string that
    is no Hugging Face id; ModelFetchError (this machine's failure) for a Hugging Face id the cache lacks
    while the hub cannot be reached."""
    path = Path(name).expanduser()
    if _exists(path):
        _check_existing(name, path)
        return
    if path.suffix.lower() == gguf.SUFFIX:
        raise ModelLoadError(f"the GGUF file {name!r} does not exist")
    if _looks_like_path(name) or not is_hub_id(name):
        raise ModelLoadError(
            f"no folder exists at {name!r}, and it is not a Hugging Face id (NAME or OWNER/NAME) either"
        )
    if catalogue.find(name) is not None:
        return
    names.refuse_typo(name)
    _check_hub_id(name, option)


def is_hub_id(name: str) -> bool:
    """Whether `name` is spelled as a Hugging Face repo id (NAME or OWNER/NAME)."""
    return bool(_HUB_ID.match(name)) and "--" not in name and ".." not in name and not name.endswith(".git")


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a NUL byte, a name too long for the file system: no path at all
        return False


def _looks_like_path(name: str) -> bool:
    """A name only a path would have: a hub id has at most one `/` and starts with neither `/`, `.` nor `~`."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or name.endswith("/")


# -- a path that exists -------------------------------------------------------------------------------------


def _check_existing(name: str, path: Path) -> None:
    if path.is_file():
        if path.suffix.lower() != gguf.SUFFIX:
            raise ModelLoadError(f"{name!r} is a file but no GGUF file (*.gguf); a model is a folder or a .gguf file")
        return
    if not path.is_dir():
        raise ModelLoadError(f"{name!r} is neither a model folder nor a GGUF file")
    if (path / HEAD_MARKER).is_file() or gguf.gguf_file(str(path)) is not None:
        return
    lacking = folder_lacks(path)
    if not lacking:
        return
    try:
        empty = next(path.iterdir(), None) is None
    except OSError as exc:
        raise ModelLoadError(f"cannot read the folder {name!r} ({exc.strerror or exc})") from None
    what = "is empty" if empty else f"lacks {' and '.join(lacking)}"
    raise ModelLoadError(
        f"the folder {name!r} {what}: a model folder holds config.json, tokenizer files "
        f"({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]}) and the weights, as save_pretrained "
        "writes them; or give one .gguf file"
    )


def folder_lacks(path: Path) -> list[str]:
    """What of a model folder `path` lacks for a tokenizer and config to load: `config.json`, `tokenizer
    files`; empty for a complete one."""
    lacking = []
    if not (path / MODEL_CONFIG).is_file():
        lacking.append(MODEL_CONFIG)
    if not _has_tokenizer_files(path):
        lacking.append("tokenizer files")
    return lacking


def _has_tokenizer_files(path: Path) -> bool:
    if any((path / file).is_file() for file in TOKENIZER_FILES):
        return True
    try:
        return any(entry.suffix in TOKENIZER_SUFFIXES for entry in path.iterdir())
    except OSError:
        return False


# -- a Hugging Face id ----------------------------------------------------------------------------------------


def _check_hub_id(name: str, option: str) -> None:
    cached = is_cached(name)
    if _offline():
        if cached:
            return
        raise ModelFetchError(
            f"{option} {name!r} is not in the local Hugging Face cache, and HF_HUB_OFFLINE keeps the hub out of "
            f"reach: {alternatives(option)}"
        )
    if any(os.environ.get(variable) for variable in _PROXY_VARIABLES):
        return  # the hub is reached through a proxy, which a direct probe does not judge
    why = hub_unreachable(endpoint(), PROBE_TIMEOUT_S)
    if why is None:
        return
    if cached:
        _go_offline(name, why)
        return
    raise ModelFetchError(
        f"cannot reach the Hugging Face hub at {endpoint()} ({why}) to fetch {option} {name!r}, and the local "
        f"cache does not hold it: {alternatives(option)}"
    )


def alternatives(option: str) -> str:
    """What a user without the hub can give as `option` instead of a Hugging Face id."""
    models = [model.name for model in catalogue.CATALOGUE]
    text = (
        "give a local model folder or a .gguf file, or a model that needs no hub: "
        f"{', '.join(models[:-1])} or {models[-1]} (`specq models` lists them)"
    )
    if option == "--draft":
        text += f", or a model-free proposer: {' or '.join(MODEL_FREE)}"
    return text


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_cache() -> Path:
    """Where huggingface_hub keeps its downloads, as it decides (its constants module, read without it)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache_home = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache_home).expanduser() / "huggingface" / "hub"


def is_cached(name: str) -> bool:
    """Whether the Hugging Face cache holds a snapshot of the model `name`."""
    snapshots = hub_cache() / f"models--{name.replace('/', '--')}" / "snapshots"
    try:
        return any(snapshots.iterdir())
    except OSError:
        return False


def hub_unreachable(url: str, timeout_s: float) -> str | None:
    """Why nothing answers at `url`'s host and port (a name that does not resolve, a refused connection, no
    answer within `timeout_s`), or None where a connection opens. In a thread: name resolution takes no
    timeout of its own."""
    parts = urlsplit(url)
    if not parts.hostname:
        return f"HF_ENDPOINT {url!r} names no host"
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return f"HF_ENDPOINT {url!r} has a bad port"
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            with socket.create_connection((parts.hostname, port), timeout=timeout_s):
                outcome.append(None)
        except OSError as exc:
            outcome.append(exc.strerror or str(exc) or type(exc).__name__)

    probe = threading.Thread(target=connect, name="specq-hub-probe", daemon=True)
    probe.start()
    probe.join(timeout_s + 0.5)
    return outcome[0] if outcome else f"no answer within {timeout_s:g}s"


def _go_offline(name: str, why: str) -> None:
    """Read `name` from the cache without asking the hub first: the hub client would retry every file five
    times before it falls back to the cache. Only before huggingface_hub is imported: it reads the variable
    once, then."""
    if "huggingface_hub" in sys.modules:
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    logger.info("the Hugging Face hub is out of reach (%s): loading %s from the local cache", why, name)
