"""specq's parts live in the repository's top-level folders, linked into specq/ (specq/cli -> ../cli, ...),
so that they install, import, type-check and lint as `specq.cli`, ... and as nothing else.

A checkout without symbolic links (Windows' default: git then writes each link as a small text file
holding its target) has none of the parts: a wheel built from it would hold specq's own few modules
alone, silently, and an import would fail on the first part it needs. `setup.py` refuses to build such a
checkout and `import specq` refuses to start from one, both naming what is missing and how to clone with
links (the README's Layout). Nothing here imports anything of specq: setup.py loads this file by path.
"""

from __future__ import annotations

from pathlib import Path

PARTS = ("bench", "cli", "db", "decoding", "distill", "jobs", "models", "worker")  # each specq/PART -> ../PART


def missing_parts(package: Path) -> list[str]:
    """The parts that the package folder `package` (specq/) lacks as packages."""
    return [part for part in PARTS if not (package / part / "__init__.py").is_file()]


def missing_parts_error(missing: list[str]) -> str:
    links = ", ".join(f"specq/{part} -> ../{part}" for part in missing)
    return (
        f"this checkout of specq lacks the links to its parts ({links}): it was made without symbolic links "
        "(on Windows, enable Developer Mode and clone with `git clone -c core.symlinks=true`), or they were "
        "deleted; see the README's Layout"
    )
