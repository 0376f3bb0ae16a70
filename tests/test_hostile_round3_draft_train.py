"""Hostile use of `specq draft train` and of training budgets, third round (issue 49, items 3 and 10).

1. `-o DIR --overwrite` never deletes what the run reads or specq keeps: a DIR that is, holds or lies
   inside the target's folder or specq's data directory, or holds the data file, is refused before
   anything is touched (a new folder beside the data file is fine); `--overwrite` deletes only a folder
   `specq draft train` wrote (its marker, DIR/.specq-draft/run.json), never another model folder.
2. `-o` a symbolic link with `--overwrite` is refused, and nothing is written where it points.
3. A budget of hundreds of digits, in `--budget` or `--draft train:N:BUDGET`, is a usage error.
4. A request over the target's context: `draft train` refuses it as a bad line (exit 2, nothing written);
   `run` counts it as failed in its progress line as its summary does.

Every folder a test could harm is a copy in its own tmp dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import pytest

from specq.budget import Budget
from specq.distill.workdir import RUN_FILE, WORK, check_output_place
from specq.errors import OutputPathError
from specq.jobs.draft_training import DraftTraining
from tests.services import invoke, write_requests
from tests.tiny_models import TINY_CORPUS

# the quickest run that writes a whole draft folder (tests/test_distill.py's)
FAST = [
    *("--proposer", "model", "--max-tokens", "8", "--budget", "500", "--checkpoint-every", "5"),
    *("--eval-warmup", "0", "--no-progress"),
]


def _prompts(count: int) -> list[dict]:
    rng = random.Random(3)
    return [
        {"id": f"p{i}", "prompt": TINY_CORPUS[start : start + 20]}
        for i, start in enumerate(rng.randrange(len(TINY_CORPUS) - 40) for _ in range(count))
    ]


def _train(target: str | Path, data: str | Path, out: str | Path, *more: str):
    return invoke(["draft", "train", "--target", str(target), "--data", str(data), "-o", str(out), *FAST, *more])


def _snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` with its content's digest: what must come out of a refusal unchanged."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture
def own_target(tiny_pair, tmp_path) -> Path:
    """A copy of the tiny target in this test's tmp dir: the code before the fix deleted it."""
    return Path(shutil.copytree(tiny_pair[0], tmp_path / "models" / "target"))


@pytest.fixture
def data(tmp_path) -> Path:
    """Six prompts in a project folder of their own, in a folder that holds no target."""
    (tmp_path / "home" / "proj").mkdir(parents=True)
    return Path(write_requests(tmp_path / "home" / "proj" / "prompts.jsonl", _prompts(6)))


# -- 1. where DIR may not be ------------------------------------------------------------------------


def test_overwrite_of_the_target_folder_is_refused_and_the_target_is_whole(own_target, data):
    before = _snapshot(own_target)
    result = _train(own_target, data, own_target, "--overwrite")
    assert result.exit_code == 2, result.output
    assert f"-o {own_target} is the target's folder" in result.stderr
    assert "Traceback" not in result.output
    assert _snapshot(own_target) == before


def test_a_dir_inside_the_target_or_holding_it_is_refused_before_anything_is_written(own_target, data):
    before = _snapshot(own_target.parent)
    inside = _train(own_target, data, own_target / "draft")
    assert inside.exit_code == 2, inside.output
    assert "lies inside the target's folder" in inside.stderr
    holding = _train(own_target, data, own_target.parent, "--overwrite")
    assert holding.exit_code == 2, holding.output
    assert f"holds the target's folder ({own_target})" in holding.stderr
    assert _snapshot(own_target.parent) == before  # no draft folder, no lock, nothing deleted
    # a path that reaches the target through `..` or a symbolic link is the same place
    link = own_target.parent.parent / "link-to-target"
    link.symlink_to(own_target)
    for spelled in (own_target / ".." / "target", link):
        again = _train(own_target, data, spelled, "--overwrite")
        assert again.exit_code == 2 and "is the target's folder" in again.stderr, again.output
    assert _snapshot(own_target.parent) == before


def test_the_data_files_folder_or_one_above_it_is_refused_a_folder_beside_the_data_is_not(own_target, data):
    before = _snapshot(data.parent)
    for out in (data.parent, data.parent.parent):
        result = _train(own_target, data, out, "--overwrite")
        assert result.exit_code == 2, result.output
        assert f"holds the data file ({data})" in result.stderr
        assert "a new folder beside it" in result.stderr
    assert _snapshot(data.parent) == before
    beside = data.parent / "my-draft"  # the common use: the draft next to its prompts
    first = _train(own_target, data, beside)
    assert first.exit_code == 0, first.output
    assert (beside / WORK / RUN_FILE).is_file()  # the marker that --overwrite looks for
    # a folder the command wrote is what --overwrite replaces
    replaced = _train(own_target, data, beside, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert json.loads((beside / WORK / RUN_FILE).read_text())["phase"] == "done"
    assert (data.parent / "prompts.jsonl").read_bytes() == data.read_bytes()


def test_specqs_data_directory_is_refused_as_dir_as_its_parent_and_inside_it(own_target, data):
    home = Path(os.environ["SPECQ_HOME"])  # the test's own (tests/conftest.py)
    (home / "models").mkdir(exist_ok=True)
    (home / "models" / "cached.bin").write_bytes(b"a converted model")
    before = _snapshot(home)
    for out, relation in ((home, "is"), (home / "models" / "draft", "lies inside"), (home.parent, "holds")):
        result = _train(own_target, data, out, "--overwrite")
        assert result.exit_code == 2, result.output
        assert f"{relation} specq's data directory" in result.stderr
    assert _snapshot(home) == before


def test_a_gguf_target_files_folder_is_kept_as_the_data_files_is(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    gguf = models / "target.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(OutputPathError, match="holds the target"):
        check_output_place(models, str(gguf), None)
    check_output_place(models / "draft", str(gguf), None)  # beside it: fine
    check_output_place(tmp_path / "elsewhere", "HuggingFaceTB/not-a-local-path", None)


def test_overwrite_deletes_no_model_folder_it_did_not_write(own_target, tiny_pair, data, tmp_path):
    # a downloaded draft: a model folder (config.json and weights), with no marker of a draft train run
    downloaded = Path(shutil.copytree(tiny_pair[1], tmp_path / "downloaded-draft"))
    before = _snapshot(downloaded)
    result = _train(own_target, data, downloaded, "--overwrite")
    assert result.exit_code == 2, result.output
    assert f"is not a folder `specq draft train` wrote (no {WORK}/{RUN_FILE})" in result.stderr
    assert _snapshot(downloaded) == before


def test_a_marker_reached_through_a_symbolic_link_is_no_marker(own_target, data, tmp_path):
    real_run = tmp_path / "real-run" / WORK
    real_run.mkdir(parents=True)
    (real_run / RUN_FILE).write_text(json.dumps({"version": 1, "phase": "done"}))
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("years of work")
    (precious / WORK).symlink_to(real_run)  # would make any folder look like a run's
    result = _train(own_target, data, precious, "--overwrite")
    assert result.exit_code == 2, result.output
    assert (precious / "thesis.txt").read_text() == "years of work"


# -- 2. -o a symbolic link ----------------------------------------------------------------------------


def test_a_symbolic_link_dir_with_overwrite_is_refused_and_nothing_lands_where_it_points(own_target, data, tmp_path):
    pointed = tmp_path / "someone-elses-run"
    (pointed / WORK).mkdir(parents=True)
    (pointed / WORK / RUN_FILE).write_text(json.dumps({"version": 1, "phase": "done", "settings": {}}))
    (pointed / "config.json").write_text("{}")
    before = _snapshot(pointed)
    link = tmp_path / "draft-link"
    link.symlink_to(pointed)
    result = _train(own_target, data, link, "--overwrite")
    assert result.exit_code == 2, result.output
    assert f"{link} is a symbolic link" in result.stderr
    assert _snapshot(pointed) == before and not (pointed / WORK / "lock").exists()
    assert link.is_symlink()


# -- 3. budgets of hundreds of digits -------------------------------------------------------------------

HUGE = "1" + "0" * 400


@pytest.mark.parametrize(
    ("text", "message"),
    [
        *((tokens, "a budget is at most 1,000,000,000,000,000 tokens") for tokens in (HUGE, HUGE + ".5", HUGE + "k")),
        (HUGE + " tokens", "a budget is at most"),
        ("1000000000000001", "a budget is at most"),
        (HUGE + "s", "is not a budget"),  # a duration past 1000 years (specq/durations.py)
    ],
)
def test_a_budget_past_the_largest_is_a_sentence_not_an_overflow(text, message):
    with pytest.raises(ValueError, match=message):
        Budget.parse(text)


def test_the_largest_budget_parses():
    assert Budget.parse("1000000000000000") == Budget(tokens=10**15)


@pytest.mark.parametrize(
    ("draft", "message"),
    [
        (f"train:5:{HUGE}", "a budget is at most"),
        ("train:" + "9" * 5000, "N has 5000 digits"),
        ("train:\u00b2", "give train:N or train:N:BUDGET"),
    ],
)
def test_a_train_n_budget_or_count_of_hundreds_of_digits_is_a_sentence(draft, message):
    with pytest.raises(ValueError, match=message):
        DraftTraining.parse(draft)


def test_budget_and_submit_draft_train_of_hundreds_of_digits_exit_2(tiny_pair, data, tmp_path):
    target = tiny_pair[0]
    trained = _train(target, data, tmp_path / "out", "--budget", HUGE)
    assert trained.exit_code == 2, trained.output
    assert "Invalid value for '--budget': a budget is at most" in trained.stderr
    assert not (tmp_path / "out").exists()
    submitted = invoke(["submit", str(data), "--target", target, "--draft", f"train:5:{HUGE}"])
    assert submitted.exit_code == 2, submitted.output
    assert "Invalid value for '--draft': a budget is at most" in submitted.stderr
    assert "Traceback" not in submitted.output and "OverflowError" not in submitted.output


# -- 4. a request over the target's context -----------------------------------------------------------


def _with_an_over_context_line(folder: Path) -> Path:
    """Six short prompts and, on line 7, one longer than the tiny target's 256 positions."""
    return Path(write_requests(folder / "prompts.jsonl", [*_prompts(6), {"id": "long", "prompt": TINY_CORPUS * 4}]))


def test_draft_train_refuses_an_over_context_prompt_as_a_bad_line_before_anything_is_written(tiny_pair, tmp_path):
    data = _with_an_over_context_line(tmp_path)
    result = _train(tiny_pair[0], data, tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert f"{data}:7: prompt (" in result.stderr
    assert "exceeds the model's context of 256 tokens" in result.stderr
    assert "1 bad line; nothing was done" in result.stderr
    assert not (tmp_path / "out").exists()


def test_run_counts_an_over_context_request_as_failed_in_its_progress_line_as_in_its_summary(
    tiny_pair, tmp_path, monkeypatch
):
    import specq.cli.progress

    monkeypatch.setattr(specq.cli.progress, "PLAIN_EVERY_S", 0.0)  # a plain line at every update, whatever the speed
    data = _with_an_over_context_line(tmp_path)
    result = invoke(
        ["run", str(data), "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair[0], "--max-tokens", "4"]
    )
    assert result.exit_code == 1, result.output  # a request failed
    lines = [line for line in result.stderr.splitlines() if line.startswith("run: ")]
    assert lines and lines[-1].startswith("run: 7/7 done, 1 failed"), result.stderr
    assert "6 completed, 1 failed of 7" in result.stderr
