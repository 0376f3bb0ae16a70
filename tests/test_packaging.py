"""The installed shape of specq: one import name, one-way imports, and commands that a user's own folder
cannot hijack.

- A wheel built from the repository has `specq` (and its dist-info) alone at its root: no generic `cli`,
  `db`, `models` ... beside a user's packages.
- The parts import one way (ALLOWED below) and no module imports itself back through others, so opening
  the database cannot run a migration behind a read-only command's back; none imports `tests`, which
  only the benchmarks in benchmarks/ may use.
- Every command works from a folder holding decoy `cli/`, `db/`, `jobs/`, `worker/`, `models.py` and
  `decoding.py` that raise on import (the workers `specq autoscale` starts: tests/test_fleet.py).
- Each module has one identity: with the repository's root on sys.path (as in this suite), none of the
  top-level folders' modules is loaded a second time under its bare name (`db.states` beside
  `specq.db.states`: two modules, two of each class).
- A checkout without the links to the parts (Windows' default) refuses to build and to import, naming
  them (specq/layout.py), where it would build a wheel of specq's few own modules silently.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specq import __version__
from specq.layout import PARTS
from tests.services import write_requests

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "specq"
SPECQ = Path(sys.executable).parent / "specq"  # the console script pip installed

# What each part may import; anything else is a flow against the layering. "core" is specq's own
# top-level modules (errors, paths, masking, the queue's shared names).
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "db": {"core"},
    "decoding": {"core"},
    "models": {"core", "decoding"},
    "jobs": {"core", "db", "decoding", "models"},
    # a job that trains its own draft (`--draft train:N`) trains it on the worker with distill's trainer
    "worker": {"core", "db", "decoding", "models", "jobs", "distill"},
    "bench": {"core", "decoding", "models", "jobs"},
    "distill": {"core", "decoding", "models", "jobs", "bench"},
    "cli": {"core", "db", "decoding", "models", "jobs", "worker", "bench", "distill"},
}


def _modules() -> dict[str, Path]:
    """{dotted name: file} of every module of the package, through the links to the top-level folders."""
    found = {}
    for folder, _, names in os.walk(PACKAGE, followlinks=True):
        for name in names:
            if name.endswith(".py"):
                path = Path(folder) / name
                dotted = ".".join(path.relative_to(REPO).with_suffix("").parts)
                found[dotted.removesuffix(".__init__")] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the specq modules it imports}, lazy imports inside functions included."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("specq"):
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _part(module: str) -> str:
    parts = module.split(".")
    if module == "specq.__main__":
        return "cli"
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else "core"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_parts_import_one_way() -> None:
    graph = _imports(_modules())
    against = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items()
        for target in targets
        if _part(target) != _part(module) and _part(target) not in ALLOWED[_part(module)]
    )
    assert against == []


def test_no_import_circle() -> None:
    assert _cycles(_imports(_modules())) == []


def test_runtime_imports_no_tests() -> None:
    # tests/ is not installed: a module that imports it works from a checkout and fails in a wheel
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported = [node.module or ""]
            else:
                continue
            found += [f"{name} imports {target}" for target in imported if target.split(".")[0] == "tests"]
    assert found == []


def test_wheel_installs_specq_alone(tmp_path) -> None:
    # built from a copy, so no build/ folder of an earlier build (stale modules included) takes part
    source = tmp_path / "source"
    skip = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(REPO, source, symlinks=True, ignore=skip)
    build = "from setuptools import build_meta; print(build_meta.build_wheel(__import__('sys').argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    wheel = tmp_path / done.stdout.strip().splitlines()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"specq", wheel.name.split("-")[0] + f"-{__version__}.dist-info"}
    assert "specq/db/migrations/versions/0001_initial_schema.py" in names
    assert "specq/cli/main.py" in names
    assert "specq/distill/run.py" in names


def _without_links(tmp_path: Path) -> Path:
    """A copy of the repository as a checkout without symbolic links has it: each link to a part is a
    small text file holding its target, as git writes it."""
    source = tmp_path / "source"
    skip = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")
    shutil.copytree(REPO, source, symlinks=True, ignore=skip)
    for link in (source / "specq").iterdir():
        if link.is_symlink():
            target = os.readlink(link)
            link.unlink()
            link.write_text(target)
    return source


def test_a_checkout_without_links_refuses_to_build_and_to_import(tmp_path) -> None:
    source = _without_links(tmp_path)
    assert not (source / "specq" / "cli").is_dir()
    build = "from setuptools import build_meta; build_meta.build_wheel(__import__('sys').argv[1])"
    done = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0 and "specq/cli -> ../cli" in done.stderr, done.stderr
    assert "core.symlinks=true" in done.stderr
    assert not list(tmp_path.glob("*.whl"))
    env = {**os.environ, "PYTHONPATH": str(source)}
    done = subprocess.run(
        [sys.executable, "-c", "import specq"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "lacks the links to its parts" in done.stderr, done.stderr


def test_every_module_has_one_identity() -> None:
    # the suite's view: every module of the package and of the tests imported, the repository's root on
    # sys.path; a module of the repository loaded under two names would be two modules
    for name in _modules():
        if name != "specq.__main__" and not name.startswith("specq.db.migrations"):  # alembic runs those
            importlib.import_module(name)
    for path in sorted((REPO / "tests").glob("*.py")):
        importlib.import_module("tests" if path.stem == "__init__" else f"tests.{path.stem}")
    names: dict[Path, list[str]] = {}
    installed = Path(sys.prefix).resolve()  # a virtual environment inside the checkout (.venv) is not its code
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file is None:
            continue
        path = Path(file).resolve()
        if path.is_relative_to(REPO) and not path.is_relative_to(installed):
            names.setdefault(path, []).append(name)
    assert {path: sorted(n) for path, n in names.items() if len(n) > 1} == {}
    assert not {name for name in sys.modules if name.split(".")[0] in PARTS}  # no top-level `db`, `cli`, ...


# -- decoys (`decoy_folder`: tests/conftest.py; autoscaled workers: tests/test_fleet.py) -------------------
def _specq(args: list[str], cwd: Path, env: dict[str, str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(SPECQ), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, f"specq {' '.join(args)}: {done.stderr}"
    assert "decoy" not in done.stderr, done.stderr
    return done


def test_embedded_commands_ignore_decoys(decoy_folder, tiny_pair, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    env.update(SPECQ_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", PYTHONPATH=str(decoy_folder))
    lines = [{"id": f"q{i}", "prompt": f"def f{i}(x):", "max_tokens": 4, "temperature": 0} for i in range(3)]
    path = write_requests(decoy_folder / "in.jsonl", lines)
    models = ["--target", tiny_pair[0], "--draft", tiny_pair[1]]

    _specq(["--help"], decoy_folder, env)
    _specq(["db", "upgrade"], decoy_folder, env)
    # the two commands that decode, side by side: each spends most of its time importing torch
    run = subprocess.Popen(
        [str(SPECQ), "run", path, "-o", "out.jsonl", *models],
        cwd=decoy_folder,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    job_id = _specq(["submit", path, *models, "--wait"], decoy_folder, env).stdout.strip()
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 0 and "decoy" not in stderr, stderr
    assert len((decoy_folder / "out.jsonl").read_text().splitlines()) == 3
    status = json.loads(_specq(["status", job_id, "--json"], decoy_folder, env).stdout)
    assert (status["state"], status["completed"]) == ("completed", 3)
    _specq(["export", job_id, "-o", "out.csv"], decoy_folder, env)
    assert (decoy_folder / "out.csv").read_text().count("\n") >= 4
    _specq(["workers", "--json"], decoy_folder, env)


def test_docs_carry_the_contract() -> None:
    """docs/contract.md is the contract users read; the shared contract beside the repository is its source."""
    shared = REPO.parent / "shared" / "CONTRACT.md"
    if not shared.exists():
        pytest.skip("no shared contract beside this checkout")
    assert (REPO / "docs" / "contract.md").read_text() == shared.read_text()
