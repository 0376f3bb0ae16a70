"""Issue 51, items 1 and 6: every long step speaks. `specq bench` says, at least every SILENCE_LIMIT_S on a
pipe, which workload, batch size and contender it is at and how far (prompts done of all, forwards timed),
through the model's load, every warm-up and timed pass and the roofline, while its tables alone go to
stdout; the suite's progress line gives an ETA that follows the rate of the last minutes, so that steady
work makes it shrink line after line.

Every gap is measured on a fake clock that moves only in the work's slowed steps (each forward of a model,
the load), with the speaker's watcher looking after each step: no verdict depends on this machine's speed."""

from __future__ import annotations

import io
import itertools
import json
import re
import threading

import click
import pytest
import torch
from click.testing import CliRunner

from specq.speaking import SILENCE_LIMIT_S, Speaker
from tests.fleet_helpers import patience
from tests.suite_progress import RATE_WINDOW_S, SuiteProgress

FORWARD_S = 4.0  # fake seconds a forward of either model takes: a 1.5B target's on 2 CPU cores, roughly
LOAD_S = 120.0  # fake seconds the pair takes to load


class LockstepClock:
    """Fake seconds that pass only in the work's slowed steps (`advance`), with the speaker's watcher in
    lockstep: after each step the watcher looks once (its `pause` returns) before the work goes on."""

    ARRIVAL_S = 30.0  # real seconds a started watcher may take to first look: a bench without one goes on

    def __init__(self) -> None:
        self.now = 0.0
        self._turn = threading.Condition()
        self._steps = 0  # advances made
        self._seen = 0  # advances the watcher was woken for
        self._looked = 0  # advances after which it looked
        self._watcher: bool | None = None  # None until it first pauses (or is given up on); False once it ended

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._turn:
            self.now += seconds
            self._steps += 1
            self._turn.notify_all()
            if self._watcher is None and not self._turn.wait_for(lambda: self._watcher is not None, self.ARRIVAL_S):
                self._watcher = False  # no watcher runs: the gaps will show it
            step = self._steps
            if not self._turn.wait_for(lambda: not self._watcher or self._looked >= step, patience(30)):
                raise AssertionError(f"the watcher did not look after step {step}")

    def pause(self, stop: threading.Event) -> bool:
        """`Speaker.watching`'s pause: back after the work's next step (False), or once the block ended (True)."""
        with self._turn:
            self._watcher = True
            self._looked = self._seen  # the look after the previous step is done
            self._turn.notify_all()
            while not self._turn.wait_for(lambda: self._steps > self._seen, timeout=0.01):
                if stop.is_set():
                    self._watcher = False
                    self._turn.notify_all()
                    return True
            self._seen = self._steps
            return False


def _longest_gap(times: list[float], start: float, end: float) -> float:
    marks = [start, *times, end]
    return max(later - earlier for earlier, later in itertools.pairwise(marks))


@pytest.fixture
def slowed_bench(monkeypatch):
    """(clock, lines): every forward of a causal LM takes FORWARD_S fake seconds and the pair's load LOAD_S;
    `specq bench`'s speaker runs on the clock, its watcher in lockstep; `lines` collects (fake time, line)
    of everything said on stderr."""
    from specq.cli import bench as bench_command
    from specq.models import loading

    clock = LockstepClock()
    lines: list[tuple[float, str]] = []
    echo = click.echo

    def timed_echo(message=None, file=None, nl=True, err=False, color=None):
        if err:
            lines.append((clock(), str(message)))
        echo(message, file, nl, err, color)

    load_pair = loading.load_pair

    def slow_load(*args, **kwargs):
        for _ in range(int(LOAD_S / FORWARD_S)):
            clock.advance(FORWARD_S)
        return load_pair(*args, **kwargs)

    def slowed(module, args):
        if type(module).__name__.endswith("ForCausalLM"):  # the model, not each of its layers
            clock.advance(FORWARD_S)

    monkeypatch.setattr(click, "echo", timed_echo)
    monkeypatch.setattr(loading, "load_pair", slow_load)
    monkeypatch.setattr(
        bench_command, "Speaker", lambda say: Speaker(say, clock=clock, pause=clock.pause), raising=False
    )
    hook = torch.nn.modules.module.register_module_forward_pre_hook(slowed)
    try:
        yield clock, lines
    finally:
        hook.remove()


def _bench(tiny_pair, tmp_path, *extra: str):
    target, draft = tiny_pair
    out = tmp_path / "bench.json"
    args = ["bench", "--target", target, "--draft", draft, "--batch-sizes", "1,2", "--num-prompts", "4"]
    args += ["--max-tokens", "8", "--prompt-chars", "64", "--device", "cpu", "--json", str(out), *extra]
    from specq.cli.main import cli

    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return result, json.loads(out.read_text())


def _check_gaps(clock: LockstepClock, lines: list[tuple[float, str]]) -> None:
    assert clock() > 20 * SILENCE_LIMIT_S, clock()  # the slowed work took many silence limits
    gap = _longest_gap([at for at, _ in lines], 0.0, clock())
    assert gap <= SILENCE_LIMIT_S, "\n".join(f"{at:7.0f}s {line}" for at, line in lines)


def test_bench_speaks_through_loading_every_pass_and_the_roofline_and_prints_only_its_tables(
    tiny_pair, tmp_path, slowed_bench
):
    from specq.bench import report

    clock, lines = slowed_bench
    result, results = _bench(tiny_pair, tmp_path, "--warmup", "1")
    _check_gaps(clock, lines)
    said = "\n".join(line for _, line in lines)
    assert re.search(r"^still loading .+ \(\d+s\)$", said, re.MULTILINE), said  # the load, in one slow call
    for contender in ("spec", "spec_fixed", "target_only", "hf_batched"):
        for which in ("warm-up pass 1 of 1", "timed pass 1 of 1"):
            assert f"B=2 {contender}: {which}" in said, (contender, which, said)
    assert re.search(r"B=\d \w+: \w+.+: \d/4 prompts done, \d+ tokens", said), said  # how far a pass got
    assert re.search(r"roofline: the (target|draft)'s eager forward at width \d: \d+ of \d+", said), said

    tables = io.StringIO()
    report.print_tables(results, file=tables)
    assert result.stdout == tables.getvalue()  # the tables, and nothing said on the way


def test_the_draft_axis_speaks_through_every_workload_and_contender_and_prints_only_its_table(
    tiny_pair, tmp_path, slowed_bench
):
    from specq.bench import draft_axis, report

    clock, lines = slowed_bench
    result, results = _bench(
        tiny_pair, tmp_path, "--workloads", "continuation", "--drafts", "draft,ngram,hf_generate", "--drop-loops"
    )
    _check_gaps(clock, lines)
    said = "\n".join(line for _, line in lines)
    assert "continuation: one target-only greedy pass finds the completions that loop" in said, said
    for contender in ("target_only", "draft", "ngram", "hf_generate"):
        assert f"continuation B=2 {contender}: timed pass 1 of 1" in said, (contender, said)

    table = draft_axis.markdown(results) + "\n" + report.roofline_markdown(results)
    assert result.stdout == table + "\n"


# -- the suite's ETA ---------------------------------------------------------------------------------


class StepClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _minutes_left(line: str) -> float:
    found = re.search(r"about ([\d.]+) min left", line)
    assert found, line
    return float(found.group(1))


def _run_suite(durations: list[float]) -> list[tuple[float, str]]:
    """The suite's progress lines, (fake time, line), for tests that take `durations` seconds one after another."""
    clock = StepClock()
    progress = SuiteProgress(len(durations), clock)
    lines = []
    for seconds in durations:
        clock.now += seconds
        line = progress.finished()
        if line is not None:
            lines.append((clock.now, line))
    return lines


def test_steady_tests_give_an_eta_that_shrinks_on_every_line_after_a_quick_start_as_after_a_slow_first_test():
    """Quick unit tests first (480 in a minute), then a steady 1.5 s a test: once the steady rate has lasted
    RATE_WINDOW_S, the ETA shrinks on every line and says the time really left (the whole run's average
    rate, quick start included, made it grow on every line). A module fixture of two minutes before a steady
    1 s a test: no line's ETA is above the one before."""
    durations = [0.125] * 480 + [1.5] * 1000
    end = sum(durations)
    lines = _run_suite(durations)
    assert lines[0] == (30.0, "-- 240 of 1480 tests, 0.5 min in; about 2.6 min left")
    steady = [(at, line) for at, line in lines if at >= 60 + RATE_WINDOW_S]
    assert len(steady) > 40
    left = [_minutes_left(line) for _, line in steady]
    assert all(later <= earlier for earlier, later in itertools.pairwise(left)), left
    for (at, _), minutes in zip(steady, left, strict=True):
        assert minutes * 60 == pytest.approx(end - at, abs=6), (at, minutes)

    left = [_minutes_left(line) for _, line in _run_suite([120.0] + [1.0] * 1000)]
    assert len(left) > 30 and all(later <= earlier for earlier, later in itertools.pairwise(left)), left
