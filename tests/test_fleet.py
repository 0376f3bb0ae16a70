"""`specq autoscale` against the real services, with real `specq worker` processes.

One autoscaler (min 0, max 2, cooldown 2 s, interval 0.5 s, 8 requests per worker) lives through:

1. idle: no worker;
2. a job arrives: two workers start at once. One of its requests kills whichever worker runs it (the
   fault-injection hook, `SPECQ_FAULT_CRASH_PROMPT`): each dead worker is replaced, the suspects run
   again by bisection until it runs alone, kills that worker too, and is failed (`--max-attempts 2`)
   with the reason; every other request completes, exactly once;
3. the backlog is gone: after the cooldown every worker is stopped (scale to zero);
4. another job arrives, workers start, and the autoscaler gets SIGTERM mid-job: it exits 0, no worker
   process is left, each worker finished its batch in hand and gave the rest of its chunk back to the
   queue (no request stays leased; every chunk holding a queued request has its message in Redis).

It runs from a user's folder holding decoy `cli/`, `db/`, `jobs/`, `worker/`, `models.py` and `decoding.py`
that raise on import (tests/conftest.py `decoy_folder`), on PYTHONPATH too: neither the autoscaler nor
any worker it starts imports them (tests/test_packaging.py checks the other commands).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import redis
from sqlalchemy import func, select

from specq.db.models import Request, Result, Worker
from specq.db.session import open_database
from specq.worker.recovery import chunks_in_broker, queued_chunks
from tests.fleet_helpers import DRILL_ENV, pid_alive, wait_for
from tests.services import (
    job_status,
    request_states,
    services_env,
    submit_job,
    wait_state,
    write_requests,
)

POISON = "POISON_PILL"


SPECQ = Path(sys.executable).parent / "specq"  # the console script pip installed


class Autoscaler:
    def __init__(self, env: dict, log_dir: Path, log_path: Path, cwd: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        args = [
            *(str(SPECQ), "autoscale"),
            *("--min", "0", "--max", "2", "--devices", "cpu", "--cooldown", "2", "--interval", "0.5"),
            *("--backlog-per-worker", "8", "--grace", "60", "--log-dir", str(log_dir)),
        ]
        self.proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=self._log)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"started worker \d+ \(pid (\d+)\)", self.output())]

    def decisions(self) -> list[tuple[int, int]]:
        """(wanted, running) of each logged decision."""
        return [(int(w), int(r)) for w, r in re.findall(r"wanted (\d+), running (\d+)", self.output())]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.pids():  # never leave a worker behind, even when the test failed
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        return self.proc.returncode


def test_autoscale_zero_to_n_to_zero_crash_loop_and_sigterm(
    pg_db_url, redis_url, tiny_pair, tmp_path, decoy_folder
) -> None:
    extra = {"SPECQ_FAULT_CRASH_PROMPT": POISON, "PYTHONPATH": str(decoy_folder), **DRILL_ENV}
    env = services_env(pg_db_url, redis_url, tmp_path / "home", **extra)
    scaler = Autoscaler(env, tmp_path / "workers", tmp_path / "autoscale.log", decoy_folder)
    try:
        # 1. idle: nothing runs
        wait_for(lambda: (0, 0) in scaler.decisions(), 60, "an idle decision")
        assert scaler.pids() == []

        # 2. 16 requests (2 chunks): two workers at once; the poisoned request kills two of them
        lines = [{"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 16, "temperature": 0} for i in range(16)]
        lines[3]["prompt"] = f"def {POISON}(x):"
        path = write_requests(tmp_path / "poison.jsonl", lines)
        args = ["--target", tiny_pair[0], "--draft", tiny_pair[1], "--batch-size", "2", "--max-attempts", "2"]
        job_id = submit_job(env, path, *args)
        # a decision's line follows the start lines of the workers it started
        wait_for(lambda: (2, 0) in scaler.decisions(), 30, "a decision for two workers from zero")
        assert len(scaler.pids()) >= 2  # both at once
        info = wait_state(env, job_id, {"completed", "failed"}, timeout=150)
        assert (info["state"], info["completed"], info["failed"]) == ("completed", 15, 1), scaler.output()
        db = open_database(pg_db_url)
        with db.session() as session:
            error = session.scalar(select(Result.error).join(Request).where(Request.custom_id == "r3"))
            starts = session.scalar(select(Request.starts).where(Request.custom_id == "r3"))
            assert session.scalar(select(func.count()).select_from(Result)) == 16
        assert error is not None and starts is not None and f"gave up after {starts} attempts" in error, error
        assert starts >= 2  # the suspects it died among are bisected (worker.claims): log2 of them, or more
        assert len(re.findall(r"exited by itself", scaler.output())) == starts  # the killed workers ...
        assert len(scaler.pids()) >= 3  # ... were replaced

        # 3. no backlog: after the cooldown, scale to zero
        wait_for(lambda: scaler.decisions()[-1] == (0, 0) and not any(map(pid_alive, scaler.pids())), 90, "zero")
        assert "scale down after" in scaler.output()

        # 4. a longer job; SIGTERM to the autoscaler while workers run it
        lines = [{"id": f"s{i}", "prompt": f"class C{i}:", "max_tokens": 48, "temperature": 0} for i in range(24)]
        path = write_requests(tmp_path / "long.jsonl", lines)
        job_id = submit_job(env, path, "--target", tiny_pair[0], "--batch-size", "2")
        wait_for(lambda: job_status(env, job_id)["completed"] > 0, 90, "the job under way")
        pids = [pid for pid in scaler.pids() if pid_alive(pid)]
        assert pids
        for pid in pids:  # the service URLs reach workers through the environment, not the command line
            assert "127.0.0.1" not in Path(f"/proc/{pid}/cmdline").read_text()
        assert scaler.stop() == 0, scaler.output()
    finally:
        scaler.stop()
    assert not any(map(pid_alive, scaler.pids())), scaler.output()
    assert "all workers stopped" in scaler.output()
    worker_logs = "".join(p.read_text() for p in (tmp_path / "workers").glob("*.log"))
    assert "decoy" not in scaler.output() + worker_logs
    with db.session() as session:
        states = request_states(session, job_id)
        assert "running" not in states, states  # nothing left leased to a stopped worker
        assert set(session.scalars(select(Worker.state).where(Worker.pid.in_(pids)))) == {"stopped"}
        _, size, total = job_id, 8, 24
        waiting = queued_chunks(session, job_id, size, total)
    if states.get("queued"):  # given back: every such chunk has its message again
        assert set(waiting) <= chunks_in_broker(redis.Redis.from_url(redis_url))
        assert "back to the queue" in "".join(p.read_text() for p in (tmp_path / "workers").glob("*.log"))
