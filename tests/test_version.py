"""One version, written once (specq/__init__.py): `specq --version`, the built wheel (pyproject.toml reads it),
the changelog's newest entry and the deploy files' image tag all name it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from click.testing import CliRunner

from specq import __version__
from specq.cli.main import _register, cli

ROOT = Path(__file__).resolve().parent.parent


def test_version_is_the_release_the_changelog_describes() -> None:
    _register()
    result = CliRunner().invoke(cli, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"specq, version {__version__}"
    changelog = (ROOT / "README.md").read_text().split("## Changelog", 1)[1]
    newest = re.search(r"^- (\d+\.\d+(?:\.\d+)?)\b", changelog, re.MULTILINE)
    assert newest, "the changelog lists no release"
    assert __version__.startswith(newest[1]), f"--version says {__version__}, the changelog's newest is {newest[1]}"


def test_pyproject_reads_the_version_from_the_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"], "a second version in pyproject.toml"
    assert "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "specq.__version__"}


def test_deploy_files_name_the_same_release() -> None:
    assert f'newTag: "{__version__}"' in (ROOT / "deploy" / "k8s" / "kustomization.yaml").read_text()
    assert f"name: specq-migrate-{__version__.replace('.', '-')}" in (ROOT / "deploy/k8s/migrate-job.yaml").read_text()
    assert f"specq:{__version__}" in (ROOT / "docker-compose.yml").read_text()
