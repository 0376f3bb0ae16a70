"""No toy training for users or the suite (issue 50, item 6): `specq demo-models` names the catalogue's
pair (pulled, never trained), `specq bench` defaults to the same pair, and scripts/test builds nothing
before pytest. Item 7's example chats are valid input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specq.cli.main import _register, cli
from specq.errors import ModelFetchError
from specq.models import catalogue

ROOT = Path(__file__).resolve().parent.parent
EVAL_LINES = f"target={catalogue.DEMO_TARGET}\ndraft={catalogue.DEMO_DRAFT}\n"


def invoke(args: list[str]):
    _register()
    return CliRunner().invoke(cli, args)


@pytest.fixture
def pulled(monkeypatch) -> list[str]:
    """The names `pull` was asked for, each answered with a progress line and no fetch."""
    from specq.models import pull

    names: list[str] = []

    def fake_pull(model, *, progress=None, **_):
        names.append(model.name)
        progress(f"{model.name}: ready")
        return model.path

    monkeypatch.setattr(pull, "pull", fake_pull)
    return names


def test_the_demo_pair_is_a_target_and_draft_of_the_catalogue() -> None:
    target, draft = catalogue.find(catalogue.DEMO_TARGET), catalogue.find(catalogue.DEMO_DRAFT)
    assert target is not None and draft is not None
    assert target.family == draft.family  # one tokenizer: a draft model must share the target's vocabulary
    assert draft.size < target.size


def test_demo_models_prints_catalogue_names_and_trains_nothing(tmp_path) -> None:
    """In a process of its own, so that nothing else has imported the toy pair's trainer."""
    code = (
        "import sys; from specq.cli.main import main; sys.argv = ['specq', 'demo-models', '--no-pull']\n"
        "try:\n    main()\nfinally:\n    print('specq.models.demo' in sys.modules, file=sys.stderr)"
    )
    env = {**os.environ, "SPECQ_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == EVAL_LINES
    assert done.stderr.strip().splitlines()[-1] == "False"
    assert not (tmp_path / "home").exists() or not any((tmp_path / "home").rglob("*.safetensors"))


def test_demo_models_pulls_the_pair_with_progress_on_stderr(pulled) -> None:
    result = invoke(["demo-models"])
    assert result.exit_code == 0, result.output
    assert pulled == [catalogue.DEMO_TARGET, catalogue.DEMO_DRAFT]
    assert result.stdout == EVAL_LINES  # only what `eval` reads
    assert f"{catalogue.DEMO_DRAFT}: ready" in result.stderr


def test_demo_models_failed_pull_is_one_line_and_prints_no_names(monkeypatch) -> None:
    from specq.models import pull

    def failing_pull(model, **_):
        raise ModelFetchError(f"cannot fetch {model.name}: no network")

    monkeypatch.setattr(pull, "pull", failing_pull)
    result = invoke(["demo-models"])
    assert result.exit_code == 1, result.output
    assert result.stdout == ""  # `eval` sets nothing rather than names of models that are not here
    assert result.stderr.strip().splitlines() == [f"Error: cannot fetch {catalogue.DEMO_TARGET}: no network"]


def test_bench_defaults_to_the_demo_pair() -> None:
    from specq.bench.runner import default_pair

    assert default_pair() == (catalogue.DEMO_TARGET, catalogue.DEMO_DRAFT)
    help_text = " ".join(invoke(["bench", "--help"]).stdout.split())
    assert "demo pair" not in help_text
    assert catalogue.DEMO_TARGET in help_text and catalogue.DEMO_DRAFT in help_text


def test_scripts_test_builds_no_models_before_pytest() -> None:
    script = (ROOT / "scripts" / "test").read_text(encoding="utf-8")
    assert "demo-models" not in script and "build_demo_models" not in script


def test_the_code_edit_chats_are_valid_chat_input() -> None:
    from specq.jobs.inputs import iter_request_specs, validate_file

    path = ROOT / "examples" / "code_edit_chats.jsonl"
    assert validate_file(path) == 6
    for spec in iter_request_specs(path):
        assert spec.messages and spec.overrides["max_tokens"] == 64 and spec.overrides["temperature"] == 0
