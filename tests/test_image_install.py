"""The Docker image holds all of specq: what the Dockerfile copies installs, and every module imports.

No container engine runs here: tests/docker_context.py rebuilds the image's files from the Dockerfile's
COPY lines and .dockerignore, links copied as links as Docker copies them. That copy is then installed
as the Dockerfile's last `pip install --no-deps .` installs it (into a folder of its own, with the
suite's interpreter lending the dependencies), and a fresh interpreter, outside the repository, imports
every module of the installed specq from there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from specq.layout import PARTS, missing_parts
from tests.docker_context import build_image_files, dockerfile_copies, final_workdir, ignored

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"

# Every module but the two that run something when imported: `python -m specq` (the CLI) and alembic's
# migration scripts (run by alembic itself, with its context).
_IMPORT_EVERY_MODULE = """
import importlib, pkgutil, sys
sys.path.insert(0, sys.argv[1])
import specq
print(specq.__file__)
def refuse(name):
    raise ImportError(f"cannot import {name}")
names = [m.name for m in pkgutil.walk_packages(specq.__path__, "specq.", onerror=refuse)]
for name in names:
    if name != "specq.__main__" and not name.startswith("specq.db.migrations"):
        importlib.import_module(name)
print(len(names))
"""


def image_app(tmp_path: Path) -> Path:
    """The emulated image's WORKDIR, where its `pip install --no-deps .` runs."""
    image = build_image_files(ROOT, DOCKERFILE, tmp_path / "image")
    return image / final_workdir(DOCKERFILE).lstrip("/")


def test_the_dockerfile_names_no_part_by_hand() -> None:
    # a hand list drifts (it once lacked distill/): the parts reach the image with the context as a whole
    sources = [Path(source) for copy in dockerfile_copies(DOCKERFILE) for source in copy.sources]
    named = {source.parts[0] for source in sources if source.parts}
    assert not named & set(PARTS), named & set(PARTS)


def test_the_image_holds_every_part_through_its_links(tmp_path) -> None:
    package = image_app(tmp_path) / "specq"
    assert missing_parts(package) == []
    for part in PARTS:
        assert (package / part).is_symlink(), part  # as Docker copies it: the link, and its folder beside it


def test_what_the_dockerfile_copies_installs_and_imports_every_module(tmp_path) -> None:
    app = image_app(tmp_path)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    done = subprocess.run(
        [*pip, "--target", str(site), str(app)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["OMP_NUM_THREADS"] = "1"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EVERY_MODULE, str(site)],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    specq_file, count = done.stdout.split()
    assert Path(specq_file).is_relative_to(site), specq_file  # not the checkout's editable install
    assert int(count) > 50


def test_dockerignore_as_docker_reads_it() -> None:
    from tests.docker_context import _Pattern, _pattern_regex

    patterns = [
        _Pattern(_pattern_regex("**/__pycache__"), False),
        _Pattern(_pattern_regex("*.egg-info"), False),
        _Pattern(_pattern_regex("docs"), False),
        _Pattern(_pattern_regex("docs/keep.md"), True),
    ]
    assert ignored("cli/__pycache__/main.pyc", patterns) and ignored("__pycache__", patterns)
    assert ignored("specq.egg-info/PKG-INFO", patterns) and not ignored("cli/x.egg-info", patterns)
    assert ignored("docs/a.md", patterns) and not ignored("docs/keep.md", patterns)
    assert not ignored("cli/main.py", patterns)
