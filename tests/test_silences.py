"""Issue 51, items 1 and 3: no phase of a command is silent for more than SILENCE_LIMIT_S (lock waits
included, naming the file and its holder), a `train:N` job's progress line says that it trains, and the
first Ctrl-C of `submit --wait` says in one line what happens to the job and exits at once.

Gaps are measured on fake clocks (specq/speaking.py, specq/paths.py file_lock take theirs), so no verdict
depends on this machine's speed."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from datetime import timedelta
from types import SimpleNamespace

import pytest

from specq.paths import file_lock
from specq.speaking import SILENCE_LIMIT_S, Speaker
from tests.fleet_helpers import patience
from tests.services import write_requests


class FakeClock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def _said(clock: FakeClock) -> tuple[list[tuple[float, str]], Speaker]:
    lines: list[tuple[float, str]] = []
    return lines, Speaker(lambda line: lines.append((clock(), line)), clock=clock)


def _longest_gap(times: list[float], start: float, end: float) -> float:
    marks = [start, *times, end]
    return max(later - earlier for earlier, later in itertools.pairwise(marks))


# -- a lock held by another process ----------------------------------------------------------------


def test_a_process_waiting_on_a_held_lock_names_the_file_and_the_holders_pid_every_15_fake_seconds(tmp_path):
    lock = tmp_path / ".model.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        clock, lines = FakeClock(), []
        polls = [0]

        def slow_poll(_seconds: float) -> None:  # each try of the lock takes 7 fake seconds; the 30th releases it
            clock.advance(7.0)
            polls[0] += 1
            if polls[0] == 30:
                assert holder.stdin is not None
                holder.stdin.close()
                holder.wait(patience(30))

        with file_lock(lock, lambda line: lines.append((clock(), line)), clock=clock, sleep=slow_poll):
            acquired_at = clock()
            assert lock.read_text().strip() == str(os.getpid())  # the new holder names itself in turn
    finally:
        holder.kill()
        holder.wait()
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None:
                pipe.close()
    assert lines, "the waiter said nothing"
    assert all(f"waiting for {lock}, held by pid {holder.pid}" in line for _, line in lines), lines
    assert _longest_gap([at for at, _ in lines], 0.0, acquired_at) <= SILENCE_LIMIT_S, lines


HOLD_LOCK = """
import sys
from pathlib import Path
from specq.paths import file_lock
with file_lock(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_lock_nobody_holds_is_taken_without_a_word(tmp_path):
    lines: list[str] = []
    with file_lock(tmp_path / ".free.lock", lines.append, sleep=lambda s: pytest.fail("waited on a free lock")):
        pass
    assert lines == []


def test_a_second_pull_waiting_on_the_first_says_whose_lock_it_waits_on(tmp_path, monkeypatch):
    """models/pull.py passes its progress to the lock: the second `eval "$(specq demo-models)"` speaks."""
    from specq.models import pull as pulling
    from specq.models.catalogue import find

    monkeypatch.setenv("SPECQ_HOME", str(tmp_path / "home"))
    model = find("smollm2-135m-instruct")
    assert model is not None
    model.folder.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    with ExitStack() as held:
        held.enter_context(file_lock(model.folder.parent / f".{model.name}.lock"))

        def fetch(parts, folder):  # reached only once the lock is free: fail the pull there, nothing to fetch
            raise pulling.ModelFetchError("stopped by the test")

        def release_soon() -> None:
            time.sleep(1.5)
            held.close()

        threading.Thread(target=release_soon, daemon=True).start()
        with pytest.raises(pulling.ModelFetchError):
            pulling.pull(model, fetch_wheels=fetch, convert=None, progress=lines.append)
    assert any(line.startswith("waiting for ") and f"held by pid {os.getpid()}" in line for line in lines), lines


# -- a phase that sits in one slow call --------------------------------------------------------------


def _run_quiet_phase(speaker: Speaker, clock: FakeClock, what, until: float) -> None:
    """A block that says nothing until the fake clock reaches `until`; the watcher's pause advances it."""

    def pause(stop: threading.Event) -> bool:
        clock.advance(4.0)  # the watcher looks every 4 fake seconds
        return stop.wait(0.001)

    with speaker.watching(what, pause=pause):
        while clock() < until:
            time.sleep(0.001)


def test_a_quiet_phase_says_still_at_least_every_30_fake_seconds():
    clock = FakeClock()
    lines, speaker = _said(clock)
    speaker.say("B=1: warming up")
    _run_quiet_phase(speaker, clock, "measuring the draft", until=600.0)
    assert len(lines) >= 600 / SILENCE_LIMIT_S
    assert all(line.startswith("still measuring the draft (") for _, line in lines[1:]), lines[:3]
    assert _longest_gap([at for at, _ in lines], 0.0, clock()) <= SILENCE_LIMIT_S


def test_a_phase_that_speaks_for_itself_is_not_interrupted():
    clock = FakeClock()
    lines, speaker = _said(clock)

    def pause(stop: threading.Event) -> bool:
        clock.advance(4.0)
        speaker.say(f"step at {clock():.0f}s")  # the phase's own line, every 4 s
        return stop.wait(0.001)

    with speaker.watching("training", pause=pause):
        while clock() < 200:
            time.sleep(0.001)
    assert not [line for _, line in lines if line.startswith("still")]


def test_draft_train_says_what_it_is_still_busy_with_in_every_silence():
    """`specq draft train`'s progress (cli/draft.py): the load before the first decode line, a slow warm-up
    inside the held-out measurement: each silence gets a `still busy` line naming the last phase."""
    from specq.cli.draft import _Shown

    clock = FakeClock()
    lines, speaker = _said(clock)
    shown = _Shown(True, speaker)
    _run_quiet_phase(speaker, clock, shown.busy, until=180.0)  # loading the target, 3 fake minutes
    shown.say("B=1: warming up")
    _run_quiet_phase(speaker, clock, shown.busy, until=900.0)  # a warm-up step of 12 fake minutes
    texts = [line for _, line in lines]
    assert texts[0].startswith("still busy (") and "since: reading the data and loading the target" in texts[0]
    assert any("since: B=1: warming up" in text for text in texts), texts
    assert _longest_gap([at for at, _ in lines], 0.0, clock()) <= SILENCE_LIMIT_S


# -- a train:N job's progress line -------------------------------------------------------------------


def test_a_training_job_status_and_progress_line_say_it_trains_the_draft_head(capsys):
    from specq.cli.follow import training_note
    from specq.cli.progress import ProgressBar
    from specq.db.models import TrainedDraft
    from specq.db.types import utcnow
    from specq.jobs.draft_training import DraftTraining
    from specq.jobs.settings import JobSettings
    from specq.jobs.status import _draft_training

    settings = JobSettings(draft_training=DraftTraining(8, "5m"))
    now = utcnow()
    row = TrainedDraft(job_id="j", state="training", started_at=now - timedelta(seconds=42))
    shown = _draft_training(settings, row, now)
    assert shown is not None and shown["training_s"] == 42.0 and shown["budget"] == "5m"
    note = training_note(SimpleNamespace(draft_training=shown))  # type: ignore[arg-type]  # what it reads of a JobStatus
    assert note == "training the draft head (42s of 5m)"

    progress = ProgressBar("job j", 24, show=True)
    progress.plain = True  # as on a pipe
    with progress:
        assert progress.update(8, 10.0, None, 0, note)  # a new note is a line at once, not a period later
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("job j: 8/24 done") and first.endswith(note)


# -- Ctrl-C ----------------------------------------------------------------------------------------


def test_ctrl_c_during_a_train_job_run_here_cancels_it_in_one_line_and_exits_130(tiny_pair, tmp_path):
    lines = [{"id": f"q{i}", "prompt": f"def f{i}(x): return x * {i} +", "max_tokens": 12} for i in range(64)]
    path = write_requests(tmp_path / "in.jsonl", lines)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    env.update(SPECQ_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")  # no broker: the job runs here
    args = ["submit", path, "--target", tiny_pair[0], "--draft", "train:8:10m", "--batch-size", "4", "--wait"]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from specq.cli.main import main; main()", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_reaches_it,
    )
    try:
        assert proc.stderr is not None
        before = _lines_until(proc, "training the draft head (")  # its 10 minutes of training have begun
        proc.send_signal(signal.SIGINT)
        stdout, after = proc.communicate(timeout=patience(60))  # the first press ends it: no second needed
    finally:
        proc.kill()
        proc.wait()
    job_id = stdout.strip()
    assert proc.returncode == 130, after
    said = [line for line in after.splitlines() if not line.startswith(f"job {job_id}: ")]  # progress lines aside
    assert said == [
        f"cancelled job {job_id} here (it ran in this process); the step under way ends, then specq exits; "
        f"`specq retry {job_id}` resumes it"
    ], (before, after)


def _ctrl_c_reaches_it() -> None:
    """As from a terminal: a suite run in the background of a non-interactive shell (or by xdist) inherits
    SIGINT ignored, and so would the command."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _lines_until(proc: subprocess.Popen, text: str) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + patience(180)
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            pytest.fail(f"specq ended before {text!r}:\n" + "".join(seen))
        seen.append(line)
        if text in line:
            return seen
    pytest.fail(f"no {text!r} line:\n" + "".join(seen))


def test_ctrl_c_while_following_a_fleet_job_leaves_it_running_in_one_line_and_exits_130(
    tiny_pair, tmp_path, pg_db_url, redis_url
):
    from tests.services import job_status, services_env, submit_job

    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", [{"id": "q1", "prompt": "def f(x):", "max_tokens": 4}])
    job_id = submit_job(env, path, "--target", tiny_pair[0])  # queued: no worker runs it
    proc = subprocess.Popen(
        [sys.executable, "-c", "from specq.cli.main import main; main()", "wait", job_id],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ctrl_c_reaches_it,
    )
    try:
        _lines_until(proc, f"job {job_id}: 0/1 done")  # it is following: its first plain progress line
        proc.send_signal(signal.SIGINT)
        _, after = proc.communicate(timeout=patience(60))
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, after
    said = [line for line in after.splitlines() if not line.startswith(f"job {job_id}: ")]
    assert said == [f"stopped following; job {job_id} goes on in the fleet: `specq wait {job_id}` follows it again"], (
        after
    )
    assert job_status(env, job_id)["state"] == "queued"  # left as it was
