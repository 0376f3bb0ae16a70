"""Issue 49 item 7: a `--draft train:N` job whose head did not train, or measures worse than no draft,
goes on without it and says so; its training phase ends by its budget in wall time, whatever the data.

The clocks are injected (an argument, or worker/faults.py's `SPECQ_FAULT_TRAINING_TICK_S`), so no
verdict here depends on how fast the machine runs."""

from __future__ import annotations

import json

import pytest

from specq.budget import Budget
from specq.db.states import DraftTrainingState
from specq.distill.corpus import Decoded
from specq.distill.job_head import USEFUL_AGREEMENT, train_job_head, wall_time_limit
from specq.worker.faults import TRAINING_TICK_ENV
from specq.worker.trained_draft import why_unusable
from tests.services import invoke, job_status, reference_greedy, write_requests

LINES = [
    {"id": f"q{i}", "prompt": f"def f{i}(x): return x * {i} +", "max_tokens": 12, "temperature": 0} for i in range(12)
]


def _ticking_clock(tick: float = 1.0):
    """A clock that advances `tick` seconds at each reading: a machine of known slowness."""
    readings = [0]

    def clock() -> float:
        readings[0] += 1
        return readings[0] * tick

    return clock


def _sequences(count: int, length: int = 6) -> list[Decoded]:
    return [
        Decoded(tuple(range(3 + i, 7 + i)), tuple((5 * i + 7 * j) % 60 + 2 for j in range(length)))
        for i in range(count)
    ]


@pytest.mark.parametrize(("model_free", "rest_with"), [(None, "target alone"), ("suffix", "model-free proposers")])
def test_a_head_whose_budget_ran_out_before_a_step_is_untrained_and_the_job_goes_on_without_it(
    tiny_pair, tmp_path, model_free, rest_with
):
    # every reading of the training's clock 10 s on: the 5 s budget is spent reading the first hidden
    # state, as on a loaded machine, before any step
    env = {"SPECQ_HOME": str(tmp_path / "home"), TRAINING_TICK_ENV: "10"}
    path = write_requests(tmp_path / "in.jsonl", LINES)
    args = ["submit", path, "--target", tiny_pair[0], "--draft", "train:4:5s", "--fixed-k", "--batch-size", "4"]
    if model_free is not None:
        args += ["--model-free", model_free]
    result = invoke([*args, "--wait"], env)
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip()

    info = job_status(env, job_id)
    assert (info["state"], info["completed"], info["failed"]) == ("completed", 12, 0)
    training = info["draft_training"]
    assert training["state"] == DraftTrainingState.UNTRAINED and training["steps"] == 0, training
    assert "ran out while the target read the hidden states" in training["reason"] and "error" not in training
    assert training["rest_with"].startswith(rest_with), training
    assert info["acceptance_by_proposer"]["draft"]["draft_tokens"] == 0  # no head ever proposed
    if model_free is None:
        assert info["num_draft_tokens"] == 0
    out = tmp_path / "out.jsonl"
    assert invoke(["export", job_id, "-o", str(out)], env).exit_code == 0
    exported = {r["id"]: r["tokens"] for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}
    assert exported == reference_greedy(tiny_pair[0], LINES)

    shown = invoke(["status", job_id], env)
    assert shown.exit_code == 0, shown.output
    line = next(text for text in shown.stdout.splitlines() if text.startswith("draft_training"))
    assert "state untrained" in line and f"rest_with {rest_with}" in line, line


def test_a_head_read_in_time_but_left_no_time_to_step_is_untrained(target):
    # 4 sequences: the read ends 5 readings in (5 s), past the 4.5 s budget, so no step runs
    trained = train_job_head(target, _sequences(4), Budget.parse("4.5s"), depth=3, clock=_ticking_clock())
    assert trained.report["steps"] == 0 and trained.report["chain_tokens"] == 0
    assert "before a training step" in trained.report["stopped"]
    state, reason = why_unusable(trained.report) or (None, "")
    assert state == DraftTrainingState.UNTRAINED and "before a training step" in reason


@pytest.mark.parametrize("budget", ["20k", "30s"])
@pytest.mark.parametrize("count", [2, 8])
def test_the_training_phase_ends_by_its_budget_in_wall_time_whatever_the_data(target, budget, count):
    # 20k chain tokens on a few 6-token completions would take hundreds of steps; a step here takes a
    # second of the injected clock, so the phase must stop at the budget's wall-time bound
    parsed = Budget.parse(budget)
    limit = wall_time_limit(parsed)
    assert limit == (60.0 if budget == "20k" else 30.0)
    trained = train_job_head(target, _sequences(count), parsed, depth=3, clock=_ticking_clock())
    report = trained.report
    assert limit <= report["seconds"] <= limit + 1.0, report  # ended at the first reading past the bound
    assert report["steps"] == limit - (count + 1), report  # one reading a step after the read's count + 1
    if budget == "20k":
        assert report["chain_tokens"] < 20_000 and "wall time ran out" in report["stopped"], report
    else:
        assert "stopped" not in report  # a time budget spent is no cut: the budget itself ended it


def test_a_head_that_measures_worse_than_no_draft_is_rejected_and_one_that_learnt_is_kept(target):
    # token budgets and a clock that stands still: no wall-time cut, the same steps on any machine
    barely = train_job_head(target, _sequences(4), Budget(tokens=30), depth=3, clock=lambda: 0.0)
    assert barely.report["steps"] == 1 and barely.report["agreement"] < USEFUL_AGREEMENT, barely.report
    state, reason = why_unusable(barely.report) or (None, "")
    assert state == DraftTrainingState.REJECTED and "of the chains it trained on" in reason

    trained = train_job_head(target, _sequences(4), Budget(tokens=3_000), depth=3, clock=lambda: 0.0)
    assert trained.report["steps"] > 1 and trained.report["agreement"] >= USEFUL_AGREEMENT, trained.report
    assert why_unusable(trained.report) is None

    state, _ = why_unusable({"chain_tokens": 0, "steps": 12, "agreement": None}) or (None, "")
    assert state == DraftTrainingState.UNTRAINED  # steps that trained no token leave it untrained
