"""What a model name means on disk: a local path as it is, a catalogue name (models/catalogue.py) its
checked GGUF file, pulled first where this process may fetch (models/pull.py), anything else (a Hugging
Face id) unchanged. The one place a `--target`/`--draft` name is looked up in the catalogue."""

from __future__ import annotations

from pathlib import Path

from specq.errors import ModelFetchError, ModelLoadError
from specq.models import catalogue
from specq.models.pull import pull


def resolve(name: str) -> str:
    """What a model name means on disk: an existing local path as it is; a catalogue name's checked GGUF
    file, fetched first where it is not local (or ModelFetchError naming the pull command, where this
    process may not fetch: allow_pulls); anything else unchanged. ModelLoadError, one line, for a bare
    word so close to a catalogue name that it is a typo of it."""
    if _exists(name):
        return name
    model = catalogue.find(name)
    if model is None:
        refuse_typo(name)
        return name
    if model.is_local():
        return str(model.path)
    if not catalogue.pulls_allowed():
        raise ModelFetchError(
            f"the catalogue model {model.name!r} is not local and this process does not fetch models "
            f"(--no-pull-models): run `{catalogue.pull_hint(model)}` first"
        )
    return str(pull(model))  # converted too, with its progress lines: the loader then finds it converted


def _exists(name: str) -> bool:
    try:
        return Path(name).expanduser().exists()
    except (OSError, ValueError):  # a NUL byte, a name too long for the file system: no path at all
        return False


def refuse_typo(name: str) -> None:
    """ModelLoadError, one line, for a bare word so close to a catalogue name that it is a typo of it."""
    if "/" in name or not name.strip():
        return  # OWNER/NAME: a Hugging Face id, never a catalogue name
    near = catalogue.closest(name, catalogue.TYPO_CUTOFF)
    if near:
        raise ModelLoadError(
            f"{name!r} is no local path and no catalogue model (did you mean {' or '.join(near)}?); "
            "`specq models` lists the catalogue"
        )
