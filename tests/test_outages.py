"""Waiting and polling commands ride out database and broker restarts (issue 14, item 11), on real servers
of the test's own (tests/private_servers.py): PostgreSQL stopped and started again, Redis restarted
(nothing saved), real `specq` processes.

- `submit --wait` sees its job through a Redis restart and then a PostgreSQL restart: one warning line,
  then the normal summary, exit 0; every request has exactly one result;
- `status`, `workers` and `export`, started while PostgreSQL is down, wait for it (one warning line
  each) and then print their normal result;
- an outage longer than SPECQ_OUTAGE_PATIENCE_S ends each of them with one line, exit 1; a bad
  SPECQ_OUTAGE_PATIENCE_S is one line naming it (exit 2) and does not disturb `run`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sqlalchemy import func, select

from specq.db.models import Job, Request, Result
from specq.db.session import open_database
from tests.fleet_helpers import DRILL_ENV, wait_for
from tests.services import invoke, services_env, submit_job, write_requests

WARNING = "warning: the database is unreachable"


class Specq:
    """A `specq` process of its own, its stderr in a file that can be read while it runs."""

    def __init__(self, args: list[str], env: dict[str, str], stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        with open(stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "specq", *args], env=env, stdout=subprocess.PIPE, stderr=err, text=True
            )

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def warned(self) -> bool:
        return WARNING in self.stderr()

    def finish(self, timeout: float = 120) -> str:
        """Its stdout, once it has exited; never a traceback on its stderr."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.communicate()
        assert "Traceback" not in self.stderr(), self.stderr()
        return out

    def warnings(self) -> int:
        return sum(WARNING in line for line in self.stderr().splitlines())


def test_waits_and_polls_ride_out_postgres_and_redis_restarts(
    private_db_url, private_postgres, private_redis, tiny_pair, start_worker, tmp_path
):
    env = services_env(private_db_url, private_redis.url(), tmp_path / "home", **DRILL_ENV)
    start_worker(env)
    small = write_requests(tmp_path / "small.jsonl", [{"id": "s", "prompt": "def f(x):", "max_tokens": 4}])
    exported_job = submit_job(env, small, "--target", tiny_pair[0], "--wait")
    lines = [{"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 32, "temperature": 0} for i in range(48)]
    path = write_requests(tmp_path / "in.jsonl", lines)
    waiting = Specq(["submit", path, "--target", tiny_pair[0], "--batch-size", "1", "--wait"], env, tmp_path / "w.err")
    db = open_database(private_db_url)

    def running_job() -> str | None:
        with db.session() as session:
            job = session.scalars(select(Job).where(Job.id != exported_job, Job.completed > 0)).one_or_none()
            return job.id if job is not None and job.state == "running" else None

    try:
        job_id = wait_for(running_job, 60, "the job to be under way", poll=0.05)
        private_redis.restart()  # every queued message lost mid-wait: the workers' sweepers enqueue them again
        out = tmp_path / "out.jsonl"
        with private_postgres.stopped():
            polls = {
                "status": Specq(["status", job_id, "--json"], env, tmp_path / "status.err"),
                "workers": Specq(["workers", "--json"], env, tmp_path / "workers.err"),
                "export": Specq(["export", exported_job, "-o", str(out)], env, tmp_path / "export.err"),
            }
            for name, poll in polls.items():
                wait_for(poll.warned, 60, f"{name} to meet the outage")
        stdouts = {name: poll.finish() for name, poll in polls.items()}
        for name, poll in polls.items():
            assert poll.proc.returncode == 0 and poll.warnings() == 1, (name, poll.stderr())
        assert json.loads(stdouts["status"])["id"] == job_id
        assert [w["state"] for w in json.loads(stdouts["workers"])] in (["idle"], ["busy"])
        assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["s"]

    finally:
        stdout = waiting.finish(timeout=180)
    assert waiting.proc.returncode == 0, waiting.stderr()
    assert stdout.strip() == job_id
    assert waiting.warnings() == 1, waiting.stderr()
    assert f"job {job_id} completed: 48 completed, 0 failed of 48" in waiting.stderr(), waiting.stderr()
    with db.session() as session:
        stored = select(func.count()).select_from(Result).join(Request).where(Request.job_id == job_id)
        assert session.scalar(stored) == 48


def test_a_hard_outage_is_one_line_and_a_bad_patience_is_named(tiny_pair, tmp_path) -> None:
    down = "postgresql+psycopg://postgres@127.0.0.1:1/specq"
    env = services_env(down, None, tmp_path / "home", SPECQ_OUTAGE_PATIENCE_S="1")
    for args in (["status"], ["status", "j", "--json"], ["workers"], ["export", "j", "-o", str(tmp_path / "x.csv")]):
        result = invoke(args, env)
        assert result.exit_code == 1, result.output
        warning, error = result.stderr.strip().splitlines()
        assert warning.startswith(f"{WARNING} (") and "trying again for up to 1 s" in warning, warning
        assert error.startswith("Error: cannot reach the database at ") and error.endswith(
            "; gave up after 1 s (SPECQ_OUTAGE_PATIENCE_S)"
        ), error

    bad = {**env, "SPECQ_OUTAGE_PATIENCE_S": "soon"}
    result = invoke(["status"], bad)
    assert result.exit_code == 2
    assert result.stderr.strip() == "Error: SPECQ_OUTAGE_PATIENCE_S must be a finite number of seconds >= 0, got 'soon'"
    path = write_requests(tmp_path / "in.jsonl", [{"id": "a", "prompt": "def f(x):", "max_tokens": 2}])
    result = invoke(["run", path, "-o", str(tmp_path / "o.jsonl"), "--target", tiny_pair[0]], bad)
    assert result.exit_code == 0, result.output
