"""The autoscaler's pieces without services: its config, its pure policy, its process supervision
(on stand-in processes that start in milliseconds)."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from specq.worker.autoscale.config import AutoscaleConfig, parse_devices
from specq.worker.autoscale.policy import PolicyState, decide, desired_workers
from specq.worker.autoscale.supervisor import Supervisor
from tests.fleet_helpers import pid_alive, wait_for

CONFIG = AutoscaleConfig(min_workers=0, max_workers=4, backlog_per_worker=10, cooldown_s=30.0)


def test_config_validation() -> None:
    assert AutoscaleConfig(min_workers=2, max_workers=2, devices=("cuda:0", "cuda:1")).devices == ("cuda:0", "cuda:1")
    for bad, words in (
        ({"min_workers": -1}, "min"),
        ({"min_workers": 3, "max_workers": 2}, "max"),
        ({"max_workers": 0}, "max"),
        ({"devices": ()}, "devices"),
        ({"devices": ("gpu0",)}, "not a device"),
        ({"backlog_per_worker": 0}, "backlog"),
        ({"cooldown_s": -1.0}, "cooldown"),
        ({"interval_s": 0.0}, "interval"),
        ({"grace_s": 0.0}, "grace"),
    ):
        with pytest.raises(ValueError, match=words):
            AutoscaleConfig(**bad)
    with pytest.raises(AttributeError):  # frozen
        CONFIG.max_workers = 9  # type: ignore[misc]
    assert parse_devices(" cuda:0, cuda:1 ,") == ("cuda:0", "cuda:1")


def test_desired_workers_is_the_clamped_ceiling() -> None:
    assert [desired_workers(CONFIG, b) for b in (0, 1, 10, 11, 25, 1000)] == [0, 1, 1, 2, 3, 4]
    kept = AutoscaleConfig(min_workers=1, max_workers=3, backlog_per_worker=10)
    assert [desired_workers(kept, b) for b in (0, 5, 100)] == [1, 1, 3]


def test_scale_up_at_once_down_after_cooldown() -> None:
    state = PolicyState()
    d = decide(CONFIG, state, backlog=35, running=0, now=0.0)
    assert (d.wanted, d.reason) == (4, "scale up")
    # the backlog drains: fewer would do, but not before 30 s of it
    d = decide(CONFIG, d.state, backlog=5, running=4, now=10.0)
    assert (d.wanted, d.desired, d.state.low_since) == (4, 1, 10.0)
    d = decide(CONFIG, d.state, backlog=0, running=4, now=39.0)
    assert (d.wanted, d.state.low_since) == (4, 10.0)
    d = decide(CONFIG, d.state, backlog=0, running=4, now=40.0)
    assert (d.wanted, d.state.low_since) == (0, None)  # scale to zero
    assert "scale down" in d.reason


def test_a_burst_resets_the_cooldown() -> None:
    d = decide(CONFIG, PolicyState(), backlog=0, running=2, now=0.0)
    assert d.wanted == 2 and d.state.low_since == 0.0
    d = decide(CONFIG, d.state, backlog=20, running=2, now=20.0)  # back up to what runs
    assert (d.wanted, d.state.low_since) == (2, None)
    d = decide(CONFIG, d.state, backlog=0, running=2, now=25.0)
    d = decide(CONFIG, d.state, backlog=0, running=2, now=50.0)
    assert d.wanted == 2  # 25 s of low backlog, not 30
    assert decide(CONFIG, d.state, backlog=0, running=2, now=55.0).wanted == 0


def test_zero_cooldown_and_steady_state() -> None:
    eager = AutoscaleConfig(min_workers=0, max_workers=2, backlog_per_worker=10, cooldown_s=0.0)
    assert decide(eager, PolicyState(), backlog=0, running=2, now=5.0).wanted == 0
    d = decide(CONFIG, PolicyState(), backlog=10, running=1, now=0.0)
    assert (d.wanted, d.reason) == (1, "steady")


# -- supervision, on stand-ins: a process that exits on SIGTERM, and one that ignores it -----------------
OBEYS = (sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)", "worker")
IGNORES = (
    sys.executable,
    "-c",
    "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(0.05)",
    "worker",
)


def supervisor(command, **config) -> Supervisor:
    settings = {"min_workers": 0, "max_workers": 4, "devices": ("cuda:0", "cuda:1"), "grace_s": 30.0, **config}
    return Supervisor(AutoscaleConfig(**settings), env={}, command=command)


def test_round_robin_placement_and_graceful_stop() -> None:
    sup = supervisor(OBEYS)
    try:
        started = [sup.start() for _ in range(3)]
        assert [w.device for w in started] == ["cuda:0", "cuda:1", "cuda:0"]
        args: list[str] = started[0].process.args  # type: ignore[assignment]
        assert args[args.index("--device") + 1] == "cuda:0"
        # metrics ports: one per running slot, from the base port
        assert [w.process.args[-1] for w in started] == ["9100", "9101", "9102"]  # type: ignore[index]
        sup.stop(started[1])  # cuda:1 is now empty: the next worker goes there
        assert sup.next_device() == "cuda:1"
        wait_for(lambda: started[1] in sup.reap(), 10, "the worker to exit on SIGTERM")
        assert [w.pid for w in sup.running()] == [started[0].pid, started[2].pid]
        # idle ones are picked first, then the newest
        assert sup.pick_to_stop(1, idle_pids={started[0].pid}) == [started[0]]
        assert sup.pick_to_stop(1, idle_pids=set()) == [started[2]]
    finally:
        sup.stop_all()
    assert not sup.workers and not any(pid_alive(w.pid) for w in started)


def test_sigkill_after_the_grace_period() -> None:
    sup = supervisor(IGNORES, grace_s=0.5)
    worker = sup.start()
    time.sleep(0.3)  # let it install its handler
    began = time.monotonic()
    sup.stop_all()
    assert 0.5 <= time.monotonic() - began < 10
    assert worker.killed and worker.process.returncode == -signal.SIGKILL


def test_quick_crashes_back_off() -> None:
    crash = (sys.executable, "-c", "raise SystemExit(3)", "worker")
    sup = supervisor(crash, min_uptime_s=30.0, max_backoff_s=4.0)
    for expected in (1.0, 2.0, 4.0, 4.0):
        worker = sup.start()
        worker.process.wait(10)
        now = sup.clock()
        assert sup.reap() == [worker]
        assert not sup.can_start()
        assert sup._start_after - now == pytest.approx(expected, abs=0.5)
        sup._start_after = 0.0  # skip the wait


def test_a_device_whose_workers_fail_to_start_is_given_up(caplog) -> None:
    """Exit 3 (device unusable) on cuda:1, three times in a row: cuda:1 is given up, said once, and the
    next workers all go to cuda:0."""
    script = (
        "import sys, time\nif sys.argv[sys.argv.index('--device') + 1] == 'cuda:1': raise SystemExit(3)\n"
        "while True: time.sleep(0.05)"
    )
    sup = supervisor((sys.executable, "-c", script, "worker"), give_up_after=3, max_backoff_s=0.0)
    try:
        assert sup.start().device == "cuda:0"
        for _ in range(3):
            failing = sup.start()
            assert failing.device == "cuda:1"
            failing.process.wait(10)
            assert sup.reap() == [failing]
        assert sup.given_up == {"cuda:1"} and sup.usable_devices() == ["cuda:0"]
        assert [sup.start().device for _ in range(2)] == ["cuda:0", "cuda:0"]
    finally:
        sup.stop_all()
    assert sum("giving up device cuda:1" in r.getMessage() for r in caplog.records) == 1


def test_workers_die_with_a_killed_supervisor(tmp_path) -> None:
    """Even an autoscaler killed with SIGKILL (no chance to stop its workers) leaves none behind: each
    child gets SIGTERM from the kernel when its parent dies (PR_SET_PDEATHSIG, Linux)."""
    import os
    import subprocess

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux only")
    script = (
        "import sys, time\n"
        "from worker.autoscale.config import AutoscaleConfig\n"
        "from worker.autoscale.supervisor import Supervisor\n"
        f"sup = Supervisor(AutoscaleConfig(max_workers=2), env={{}}, command={list(OBEYS)!r})\n"
        "print(sup.start().pid, sup.start().pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(map(pid_alive, pids))
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    wait_for(lambda: not any(map(pid_alive, pids)), 10, "the orphaned workers to exit")
