"""Issue 49, items 8 and 9: only a worker's death makes a suspect, and suspects are isolated by bisection.

Each "worker life" here is a process of its own that runs one chunk (`worker.chunk.run_chunk`, the
Celery task's body) against the test's PostgreSQL and exits; a life killed by the fault hook
(`SPECQ_FAULT_CRASH_PROMPT`: SIGKILL as the poisoned request enters the engine) dies for real, holding
its claims. The test stands in for the clock: instead of waiting out a lease, it expires the dead
life's leases, so no verdict depends on the machine's speed.

- cancel, then retry, five times over: the requests a live worker gave up as cancelled keep no start,
  so none comes back a suspect and none spends an attempt; the job then completes;
- a poisoned request among 16 suspects: halves, then quarters ..., so it costs about log2(16) worker
  deaths and 2 log2(16) + 1 engine runs (batches), not 16 single-request runs; it fails with the reason,
  and the 15 others complete with the target's own greedy output.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select, update

from specq.db.models import Batch, Job, Request, Result
from specq.db.session import Database
from specq.db.types import utcnow
from specq.decoding.config import DecodingConfig
from specq.jobs.control import cancel_job, retry_job
from specq.jobs.settings import JobSettings
from specq.jobs.submit import JobSpec
from specq.jobs.submit import submit_job as store_job
from specq.worker.claims import ClaimedRequest, exhausted, suspect_groups
from tests.fleet_helpers import wait_for
from tests.services import invoke, write_requests

POISON = "POISON_PILL"

LIFE = """
import sys
from specq.db.session import open_database
from specq.worker.chunk import run_chunk
from specq.worker.context import WorkerContext

url, name, job_id, first, end = sys.argv[1:]
ctx = WorkerContext(open_database(url), name, "cpu")
print(run_chunk(ctx, job_id, int(first), int(end)), flush=True)
"""


STARTED: list[Life] = []


@pytest.fixture(autouse=True)
def _no_life_left_behind():
    """Whatever a test asserted, no worker process of it outlives it."""
    yield
    while STARTED:
        life = STARTED.pop()
        if life.proc.poll() is None:
            life.proc.send_signal(signal.SIGKILL)
        life.wait()


class Life:
    """One worker process running one chunk of a job, its output in a log file."""

    def __init__(self, db_url: str, name: str, job_id: str, total: int, log: Path, **env: str) -> None:
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 (closed in wait)
        environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
        args = [sys.executable, "-c", LIFE, db_url, name, job_id, "0", str(total)]
        self.proc = subprocess.Popen(args, env=environ, stdout=self._log, stderr=subprocess.STDOUT)
        STARTED.append(self)

    def wait(self) -> int:
        code = self.proc.wait(600)
        self._log.close()
        return code

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


def store(db_url: str, tmp_path: Path, target: str, lines: list[dict], **settings) -> tuple[str, Database]:
    path = write_requests(tmp_path / "in.jsonl", lines)
    submitted = store_job(path, JobSpec(target, None, JobSettings(**settings)), database_url=db_url)
    return submitted.job_id, submitted.db


def expire_leases(db, job_id: str) -> None:
    """What the clock does to a dead worker's claims: their leases run out."""
    with db.session() as session:
        session.execute(
            update(Request)
            .where(Request.job_id == job_id, Request.state == "running")
            .values(lease_expires_at=utcnow() - timedelta(seconds=1))
        )


# -- bisection, on its own ------------------------------------------------------------------------------
def claimed(seq: int, starts: int, start_group: int) -> ClaimedRequest:
    return ClaimedRequest(seq, seq, str(seq), "completion", "p", None, {}, None, starts, start_group)


def test_suspects_split_in_halves_and_untried_halves_stay_whole() -> None:
    fresh_death = [claimed(i, 1, 0) for i in range(16)]
    assert [len(g) for g in suspect_groups(fresh_death)] == [8, 8]
    # the first half died again (its members marked started in a group of 8); the second never started
    after = [claimed(i, 2, 8) for i in range(8)] + [claimed(i, 1, 0) for i in range(8, 16)]
    groups = suspect_groups(after)
    assert [[c.seq for c in g] for g in groups] == [list(range(8, 12)), list(range(12, 16)), [0, 1, 2, 3], [4, 5, 6, 7]]
    # a quarter died; the other quarter of its half, untried, runs whole
    after = [claimed(i, 3, 4) for i in (4, 5, 6, 7)] + [claimed(i, 2, 8) for i in (0, 1, 2, 3)]
    assert [[c.seq for c in g] for g in suspect_groups(after)] == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert [[c.seq for c in g] for g in suspect_groups([claimed(5, 4, 2), claimed(4, 4, 2)])] == [[4], [5]]


def test_only_a_death_alone_or_more_than_bisection_explains_exhausts_a_suspect() -> None:
    assert not exhausted(2, 0, 3, 16)  # not yet max_attempts
    assert exhausted(3, 1, 3, 16)  # killed 3 workers, the last alone: the culprit
    assert not exhausted(3, 2, 3, 16)  # its group of 2 may hold the culprit: bisection goes on
    assert exhausted(3 + 5, 2, 3, 16)  # more deaths than bisecting 16 takes: nothing loops for ever


# -- item 8: cancel, then retry, spends nothing ---------------------------------------------------------
def freeze_while_holding_started(db, job_id: str, life: Life) -> bool:
    """True once `life` is frozen (SIGSTOP) while it holds requests it counted started; False (and thawed)
    when it got there first, or has not started any yet."""

    def holding() -> int:
        with db.session() as session:
            return (
                session.scalar(
                    select(func.count()).where(Request.job_id == job_id, Request.state == "running", Request.starts > 0)
                )
                or 0
            )

    if life.proc.poll() is not None or not holding():
        return False
    life.proc.send_signal(signal.SIGSTOP)
    if holding():
        return True
    life.proc.send_signal(signal.SIGCONT)
    return False


def test_cancel_then_retry_five_times_spends_no_attempt_and_the_job_completes(pg_db_url, tiny_pair, tmp_path) -> None:
    lines = [{"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 48, "temperature": 0} for i in range(40)]
    # two attempts: before the fix, the second cancel left requests that had "killed" two workers
    settings = {"decoding": DecodingConfig(batch_size=2), "max_attempts": 2}
    job_id, db = store(pg_db_url, tmp_path, tiny_pair[0], lines, **settings)
    cycles = 0
    while cycles < 5:
        life = Life(pg_db_url, f"life{cycles}", job_id, len(lines), tmp_path / f"life{cycles}.log")

        def frozen_or_done(life: Life = life) -> bool:
            return freeze_while_holding_started(db, job_id, life) or life.proc.poll() is not None

        frozen = wait_for(
            frozen_or_done,
            120,
            "a worker holding started requests",
            poll=0.02,
        )
        if life.proc.poll() is not None:  # it finished its chunk before it could be caught: no cycle
            assert life.wait() == 0, life.output()
            break
        assert frozen is True
        assert cancel_job(db, job_id).changed
        life.proc.send_signal(signal.SIGCONT)  # it sees the cancel at its next write, and gives up the rest
        assert life.wait() == 0, life.output()
        assert "worker that died" not in life.output()
        outcome = retry_job(db, job_id)
        assert outcome.requeued.get("cancelled", 0) > 0 and not outcome.winding_down, outcome
        with db.session() as session:  # nothing a live worker gave up counts as a start
            assert not session.scalar(
                select(func.max(Request.starts)).where(Request.job_id == job_id, Request.state != "completed")
            )
        cycles += 1
    assert cycles == 5, "the job finished before five cancels: make it longer"
    last = Life(pg_db_url, "last", job_id, len(lines), tmp_path / "last.log")
    assert last.wait() == 0, last.output()
    assert "worker that died" not in last.output()
    with db.session() as session:
        job = session.get_one(Job, job_id)
        assert (job.state, job.completed, job.failed) == ("completed", len(lines), 0)


# -- item 9: bisection after a worker's death -----------------------------------------------------------
def reference_outputs(target: str, lines: list[dict], tmp_path: Path) -> dict[str, list[int]]:
    """`specq run` (in-process, target alone) of `lines`: {id: tokens}."""
    path = write_requests(tmp_path / "ref.jsonl", lines)
    out = tmp_path / "ref.out.jsonl"
    result = invoke(["run", path, "-o", str(out), "--target", target])
    assert result.exit_code == 0, result.output
    return {r["id"]: r["tokens"] for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}


def test_a_poisoned_suspect_is_isolated_by_bisection_in_about_log2_n_batches(pg_db_url, tiny_pair, tmp_path) -> None:
    n = 16
    lines = [{"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 16, "temperature": 0} for i in range(n)]
    lines[5]["prompt"] = f"def {POISON}(x):"
    job_id, db = store(pg_db_url, tmp_path, tiny_pair[0], lines, decoding=DecodingConfig(batch_size=4))
    # a worker died holding all 16, every one of them started: 16 suspects
    with db.session() as session:
        session.execute(
            update(Request)
            .where(Request.job_id == job_id)
            .values(state="running", lease_owner="dead", lease_expires_at=utcnow(), starts=1, start_group=0)
        )
    expire_leases(db, job_id)
    deaths, lives = 0, 0
    while lives < 12:
        log = tmp_path / f"life{lives}.log"
        life = Life(pg_db_url, f"life{lives}", job_id, n, log, SPECQ_FAULT_CRASH_PROMPT=POISON)
        code = life.wait()
        lives += 1
        assert code in (0, -signal.SIGKILL), life.output()
        assert "Traceback" not in life.output(), life.output()
        if code == 0:
            break
        deaths += 1
        expire_leases(db, job_id)
    with db.session() as session:
        job = session.get_one(Job, job_id)
        batches = session.scalar(select(func.count()).select_from(Batch).where(Batch.job_id == job_id))
        rows = session.execute(
            select(Request.custom_id, Request.starts, Result.status, Result.error, Result.token_ids)
            .join(Result)
            .where(Request.job_id == job_id)
        ).all()
    assert (job.state, job.completed, job.failed) == ("completed", n - 1, 1)
    poisoned = next(row for row in rows if row.custom_id == "r5")
    assert poisoned.status == "failed" and f"gave up after {poisoned.starts} attempts" in poisoned.error
    # about log2(n) deaths and engine runs; running each suspect alone took n runs (and 3 deaths)
    assert deaths <= math.log2(n), deaths
    assert batches is not None and batches <= 2 * math.log2(n) + 1, batches
    expected = reference_outputs(tiny_pair[0], [line for line in lines if line["id"] != "r5"], tmp_path)
    assert {row.custom_id: row.token_ids for row in rows if row.status == "completed"} == expected
