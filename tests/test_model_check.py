"""Submit's model check remembers pairs of local folders that passed, and only those very folders: a
folder whose files changed is checked again, every pair after an upgrade of its loaders, a hub id every
time."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from specq.errors import ModelLoadError
from specq.jobs import model_check
from specq.jobs.model_check import ModelCheck, passed_before, remember_passed


@pytest.fixture
def pair(tiny_pair, tmp_path, monkeypatch):
    """Copies of the tiny pair (the test changes them), and a data directory of the test's own."""
    monkeypatch.setenv("SPECQ_HOME", str(tmp_path / "home"))
    target, draft = (str(shutil.copytree(d, tmp_path / d.name)) for d in map(Path, tiny_pair))
    return target, draft


def test_a_pair_that_passed_is_not_checked_again_until_a_file_changes(pair) -> None:
    target, draft = pair
    assert not passed_before(target, draft)
    with ModelCheck(target, draft) as check:
        check.wait()
    assert passed_before(target, draft)
    assert not passed_before(target, None)  # the target alone is another pair

    # the draft's tokenizer no longer matches: the remembered pass must not hide it
    tokenizer = Tokenizer.from_file(f"{draft}/tokenizer.json")
    tokenizer.add_tokens(["<one more token>"])
    tokenizer.save(f"{draft}/tokenizer.json")
    assert not passed_before(target, draft)
    with pytest.raises(ModelLoadError, match="does not share the vocabulary"), ModelCheck(target, draft) as check:
        check.wait()
    assert not passed_before(target, draft)


def test_a_failed_check_is_not_remembered(pair, tmp_path) -> None:
    missing = str(tmp_path / "nope")
    (tmp_path / "nope").mkdir()
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"), ModelCheck(missing, None) as check:
        check.wait()
    assert not passed_before(missing, None)


def test_hub_ids_are_never_remembered(pair) -> None:
    remember_passed("someone/some-model", None)
    assert not passed_before("someone/some-model", None)
    remember_passed(pair[0], "someone/some-draft")
    assert not passed_before(pair[0], "someone/some-draft")


def test_an_unwritable_data_directory_costs_a_check_not_the_submit(pair, tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECQ_HOME", str(blocker / "home"))  # mkdir fails: a file is in the way
    with ModelCheck(*pair) as check:
        check.wait()
    assert not passed_before(*pair)


def test_an_upgrade_of_the_loaders_checks_again(pair, monkeypatch) -> None:
    remember_passed(pair[0], pair[1])
    assert passed_before(*pair)
    monkeypatch.setattr(model_check, "LOADERS", ("transformers", "a-package-that-is-not-installed"))
    assert not passed_before(*pair)
