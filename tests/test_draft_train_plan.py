"""`specq draft train`'s plan and `--time-limit` (distill/plan.py): the plan, an estimate a phase from a
probe of the target, is said before the target decodes; under a limit the whole command ends within it,
counted on a fake clock that the models' forwards and the training steps advance (never wall time);
a limit too short for a minimal run is refused in one line before the decode, leaving no DIR; and a
run resumed under a limit plans only what is left and keeps the bound."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from specq.budget import Budget
from specq.decoding import SamplingParams
from specq.distill.head import HeadTrainer
from specq.distill.run import train_draft
from specq.distill.settings import DistillSettings
from tests.services import invoke, write_requests
from tests.test_distill import Killed, _prompt_lines

FORWARD_S = 1.0  # fake seconds a forward of a Llama model costs: the target's, whatever its rows and tokens
STEP_S = 0.5  # fake seconds a head's training step costs (it runs no Llama forward)
TRAINING_PROMPTS = 23  # _prompt_lines(24): 25 prompts, 2 of them held out


class FakeClock:
    """Seconds that pass only as the target works (`forwards_cost`) and the head trains (the `clock` fixture)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@contextmanager
def forwards_cost(clock: FakeClock, seconds: float = FORWARD_S) -> Iterator[None]:
    """Within: every forward of a Llama model (a decode step, a prefill, a read of hidden states, a verify)
    advances `clock` by `seconds`: a slow target, on the fake clock alone."""
    from transformers.models.llama.modeling_llama import LlamaModel

    def cost(module: torch.nn.Module, args: object, output: object) -> None:
        if isinstance(module, LlamaModel):
            clock.advance(seconds)

    handle = torch.nn.modules.module.register_module_forward_hook(cost)
    try:
        yield
    finally:
        handle.remove()


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """A fake clock that each of the head's training steps advances by STEP_S (a slowed step)."""
    clock = FakeClock()
    step = HeadTrainer.step

    def slowed(self: HeadTrainer) -> float:
        clock.advance(STEP_S)
        return step(self)

    monkeypatch.setattr(HeadTrainer, "step", slowed)
    return clock


class Recorded:
    """The command's progress (distill/run.py Progress) as (fake time, kind, what) events;
    `kill_after_decoded` stands for a kill once that many prompts are decoded."""

    def __init__(self, clock: FakeClock, kill_after_decoded: int | None = None) -> None:
        self.clock, self.kill_after_decoded = clock, kill_after_decoded
        self.events: list[tuple[float, str, str]] = []

    def say(self, message: str) -> None:
        self.events.append((self.clock(), "say", message))

    def decoding(self, done: int, total: int, stats: object) -> None:
        self.events.append((self.clock(), "decoded", str(done)))
        if done == self.kill_after_decoded:
            raise Killed

    def reading(self, done: int, total: int, tokens: int) -> None:
        pass

    def training(self, state: object, budget: Budget) -> None:
        self.events.append((self.clock(), "trained", ""))

    def said(self) -> list[str]:
        return [what for _, kind, what in self.events if kind == "say"]

    def plan(self) -> list[str]:
        """The plan's lines: its heading and the indented lines after it."""
        said = self.said()
        start = next(i for i, line in enumerate(said) if line.startswith("plan ("))
        end = next((i for i in range(start + 1, len(said)) if not said[i].startswith("  ")), len(said))
        return said[start:end]

    def first(self, kind: str) -> int:
        return next(i for i, (_, event, _) in enumerate(self.events) if event == kind)


def _seconds(text: str) -> float:
    """A span as the plan prints it (45s, 3m20s, 1h05m) in seconds."""
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    assert match and text, text
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def _estimate(line: str) -> float:
    return _seconds(re.search(r"~(\S+)", line).group(1))  # type: ignore[union-attr]


def _settings(target: str, data: str, budget: Budget, batch_size: int = 32) -> DistillSettings:
    return DistillSettings(
        target=target,
        data=data,
        sampling=SamplingParams(max_tokens=16, temperature=0.0),
        decode_batch_size=batch_size,
        budget=budget,
        proposer="head",
        checkpoint_every=5,
        eval_warmup=0,
        eval_compile="off",  # a compile's time is not in the plan's estimate
    )


@pytest.fixture
def prompts(tmp_path) -> str:
    return write_requests(tmp_path / "prompts.jsonl", _prompt_lines(24))


def test_the_plan_is_said_before_the_target_decodes_with_an_estimate_a_phase(tiny_pair, prompts, tmp_path, clock):
    target, _ = tiny_pair
    progress = Recorded(clock)
    with forwards_cost(clock):
        outcome = train_draft(
            _settings(target, prompts, Budget(tokens=2000), 4), tmp_path / "head", progress, clock=clock
        )
    plan = progress.plan()
    heading, decode, hidden, training, measurement, total = plan
    # said before the first prompt is decoded, after a probe that cost the fake clock its forwards
    plan_said = progress.events.index(next(event for event in progress.events if event[2] == heading))
    assert plan_said < progress.first("decoded")
    assert heading.startswith("plan (") and "tokens/s at 4 rows" in heading and "tokens/s at 1 row" in heading
    assert decode.startswith(f"  decode: the target completes {TRAINING_PROMPTS} training prompts (4 rows at a time)")
    assert hidden.startswith(f"  hidden states: the target reads {TRAINING_PROMPTS} sequences ~")
    assert training == "  training: 2000 tokens (--budget; its time is not known before it starts)"
    assert measurement.startswith("  held-out measurement: 2 prompts at batch 1 ~")
    assert total.startswith("  total: ~") and total.endswith(" and the training")
    # the estimates lean long, and not by much: each phase's fake time against its estimate
    times = {what: at for at, kind, what in progress.events if kind == "say"}
    decoding = next(what for what in times if what.startswith("the target decodes"))
    reading = next(what for what in times if what.startswith("the target reads"))
    measuring = next(what for what in times if what.startswith("measuring the draft"))
    decode_s = times[next(what for what in times if what.startswith("a draft head ("))] - times[decoding]
    read_s = times[next(what for what in times if what.startswith("read "))] - times[reading]
    measure_s = clock() - times[measuring]
    for estimate, spent in (
        (_estimate(decode), decode_s),
        (_estimate(hidden), read_s),
        (_estimate(measurement), measure_s),
    ):
        assert spent <= estimate <= 3 * spent + 2, plan
    assert outcome.train_prompts == outcome.training_prompts_in_file == TRAINING_PROMPTS


def test_a_time_limit_bounds_the_whole_command_on_the_clock(tiny_pair, prompts, tmp_path, clock):
    """A target too slow for all of it (2 rows at a time: a dozen waves of 16 forwards) and the default
    budget (200k chain tokens: some 500 steps, 4 fake minutes): fewer prompts decoded, training stopped by
    the limit, and the command ends within it."""
    target, _ = tiny_pair
    limit = 300.0
    progress = Recorded(clock)
    settings = _settings(target, prompts, Budget(tokens=200_000), batch_size=2)
    with forwards_cost(clock):
        outcome = train_draft(settings, tmp_path / "head", progress, clock=clock, time_limit_s=limit)
    assert clock() <= limit  # the whole command: probe, decode, hidden states, training, measurement
    plan = progress.plan()
    assert plan[-1].startswith("  total: ~") and plan[-1].endswith(" of --time-limit 5m00s")
    assert _estimate(plan[-1]) <= limit
    sample = rf"  decode: the target completes \d+ of {TRAINING_PROMPTS} training prompts \(a seeded sample: all"
    assert re.match(sample, plan[1]), plan
    assert re.fullmatch(r"  training: 200000 tokens or ~\S+, whichever ends first \(--time-limit\)", plan[3])
    assert 1 <= outcome.train_prompts < TRAINING_PROMPTS == outcome.training_prompts_in_file
    assert outcome.state["step"] > 0 and outcome.state["stopped"].startswith("--time-limit stopped it at ")
    assert outcome.evaluation["rows"][0]["same_output"]  # the measurement ran whole, after training stopped


def test_a_time_budget_that_fits_the_limit_is_trained_whole(tiny_pair, prompts, tmp_path, clock):
    target, _ = tiny_pair
    progress = Recorded(clock)
    settings = _settings(target, prompts, Budget(seconds=60.0), batch_size=8)
    with forwards_cost(clock):
        outcome = train_draft(settings, tmp_path / "head", progress, clock=clock, time_limit_s=1800.0)
    assert clock() <= 1800.0
    plan = progress.plan()
    assert plan[1].startswith(f"  decode: the target completes {TRAINING_PROMPTS} training prompts (8 rows at a time)")
    assert re.fullmatch(r"  training: ~\d+s \(--budget 60s, less the hidden states' read\)", plan[3]), plan
    assert outcome.train_prompts == TRAINING_PROMPTS
    assert "stopped" not in outcome.state and outcome.state["elapsed_s"] >= 60.0


def test_a_limit_too_short_for_a_minimal_run_is_refused_in_one_line_before_the_decode(tiny_pair, prompts, tmp_path):
    target, _ = tiny_pair
    out = tmp_path / "head"
    result = invoke(
        ["draft", "train", "--target", target, "--data", prompts, "-o", str(out), "--time-limit", "5s", "--no-progress"]
    )
    assert result.exit_code == 2, result.output
    error = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and "--time-limit 5s cannot fit even a minimal run" in error[0], result.stderr
    assert re.search(r"give at least \S+$", error[0])
    assert "decodes" not in result.stderr and not out.exists()  # nothing decoded, no DIR left to --overwrite


def test_a_run_resumed_under_a_limit_plans_what_is_left_and_keeps_the_bound(tiny_pair, prompts, tmp_path, clock):
    target, _ = tiny_pair
    settings = _settings(target, prompts, Budget(seconds=600.0), batch_size=2)
    with pytest.raises(Killed), forwards_cost(FakeClock()):
        train_draft(settings, tmp_path / "head", Recorded(FakeClock(), kill_after_decoded=5), clock=FakeClock())
    limit = 400.0
    progress = Recorded(clock)
    with forwards_cost(clock):
        outcome = train_draft(settings, tmp_path / "head", progress, clock=clock, time_limit_s=limit)
    assert clock() <= limit and outcome.resumed
    assert progress.said()[0] == f"resuming the unfinished run in {tmp_path / 'head'} (phase: decode)"
    plan = progress.plan()
    assert "; 5 decoded by an earlier try: all would not fit)" in plan[1], plan
    assert re.fullmatch(r"  training: ~\S+ of --budget 600s, less the hidden states' read \(--time-limit\)", plan[3])
    assert 5 < outcome.train_prompts < TRAINING_PROMPTS  # the five kept, and more decoded within the limit
    assert outcome.state["stopped"].startswith("--time-limit stopped it at ")


def test_the_help_says_which_phases_each_option_bounds():
    result = invoke(["draft", "train", "--help"], env={"COLUMNS": "400"})
    text = " ".join(result.output.split())
    assert "It bounds the training phase alone (a head's includes the target's read of its hidden states)" in text
    assert "not the target's decoding before it nor the held-out measurement after it" in text
    assert "--time-limit DURATION A bound on the whole command, from its start to its last line" in text
    for phase in ("loading the target", "a probe of its speed", "its decoding of the training prompts",
                  "a head's read of the hidden states", "training and the held-out measurement"):  # fmt: skip
        assert phase in text
