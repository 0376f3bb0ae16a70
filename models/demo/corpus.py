"""The demo models' text: the Python standard library's own sources, split into training files and
held-out files, and the held-out code prompts that measure the pair and feed the benchmark.

Deterministic on a given Python installation: files are sorted by relative path, the split is by position.
"""

from __future__ import annotations

import ast
import io
import sysconfig
import tokenize
from pathlib import Path

HELDOUT_EVERY = 20  # every 20th corpus file is held out from training
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings", "pydoc_data"}
)
_MAX_FILE_BYTES = 300_000  # larger stdlib files are generated tables, not code worth learning


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files() -> list[Path]:
    """The stdlib's .py files, sorted by relative path; no tests, no third-party or generated files."""
    root = stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if path.is_file() and path.stat().st_size <= _MAX_FILE_BYTES:
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, heldout): every HELDOUT_EVERY-th file is held out."""
    train = [p for i, p in enumerate(files) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [p for i, p in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return train, heldout


def read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _function_starts_and_strings(text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Offsets of the real `def` lines (not examples inside docstrings) and the spans of string literals."""
    line_starts = [0]
    for line in text.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    try:
        tree = ast.parse(text)
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (SyntaxError, tokenize.TokenError, ValueError):
        return [], []
    starts = sorted(
        line_starts[node.lineno - 1] + node.col_offset
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    )
    strings = [
        (line_starts[tok.start[0] - 1] + tok.start[1], line_starts[tok.end[0] - 1] + tok.end[1])
        for tok in tokens
        if tok.type == tokenize.STRING
    ]
    return starts, strings


def heldout_prompts(n: int, prompt_chars: int = 256) -> list[str]:
    """n deterministic code prompts from held-out files: the start of a function, up to about
    `prompt_chars` characters, ending at the end of a code line (the model continues with a newline),
    not inside a docstring or on a comment."""
    if n < 1:
        raise ValueError(f"n must be at least 1, not {n}")
    _, heldout = split_files(corpus_files())
    candidates = []
    for path in heldout:
        text = read_source(path)
        starts, strings = _function_starts_and_strings(text)
        for start in starts:
            chunk = text[start : start + prompt_chars]
            cut = chunk.rfind("\n")
            # A prompt of one short line says too little; skip functions whose first lines are long.
            if cut < prompt_chars // 2:
                continue
            prompt = chunk[:cut].rstrip()
            end = start + len(prompt)
            # Continuing code is what a demo shows; a docstring or comment is prose.
            if any(low < end < high for low, high in strings) or prompt.splitlines()[-1].lstrip().startswith("#"):
                continue
            candidates.append(prompt)
    if n > len(candidates):
        raise ValueError(f"only {len(candidates)} held-out prompts of {prompt_chars} characters exist")
    # Evenly spread over the held-out files, not the first n functions of the first file.
    return [candidates[i * len(candidates) // n] for i in range(n)]
