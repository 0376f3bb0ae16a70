"""Failure drills against real servers of the tests' own (tests/private_servers.py: the drills restart
them) and real `specq worker` processes.

Two workers serve a module-scoped database with short lease, heartbeat and sweep timings (3 s, 0.5 s,
1 s), so each drill takes seconds. In each, a job is under way when something breaks; every drill
ends with every request holding exactly one result, the job's counters matching them, and the greedy
completions token for token those of the target run alone:

- Redis restarted (every queued and unacknowledged message is gone): the sweepers find the chunks
  that hold queued requests but no message, and enqueue them again;
- PostgreSQL restarted (every connection cut): the chunk tasks retry with backoff, the heartbeats
  carry on, nothing is half-written;
- a worker killed with SIGKILL mid-batch: its leases expire, its requests are requeued and finished by
  the other worker, and the results are those of `specq run` on the same file.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import redis
from sqlalchemy import func, select

from specq.db.models import Job, Request, Result
from specq.db.session import open_database
from tests.fleet_helpers import DRILL_ENV, freeze_a_worker_mid_chunk, wait_for
from tests.services import (
    SpecqWorker,
    create_database,
    invoke,
    job_status,
    request_states,
    services_env,
    submit_job,
    wait_state,
    write_requests,
)

PROMPTS = [f"def f{i}(x):" for i in range(64)]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def fleet(private_postgres, private_redis, tmp_path_factory):
    """A database and a Redis of this module's own (the drills restart both servers), and two workers
    with short timings."""
    db_url = create_database("specq_recovery", private_postgres.admin_url)
    client = redis.Redis.from_url(private_redis.url())
    client.flushdb()  # the server is this suite's own (the outage drills may have used it before)
    home = tmp_path_factory.mktemp("recovery_home")
    env = services_env(db_url, private_redis.url(), home, **DRILL_ENV)
    workers = [SpecqWorker(env, home / f"worker{i}.log") for i in range(2)]
    try:
        for worker in workers:
            worker.wait_ready()
        yield env, workers
    finally:
        for worker in workers:
            worker.stop()
        for worker in workers:
            assert "Traceback" not in worker.output(), worker.output()
        client.flushdb()


@pytest.fixture(scope="module")
def reference(tiny_pair, tmp_path_factory) -> dict[str, dict]:
    """`specq run` (in-process, no queue) on every prompt of the drills: {prompt: output line}."""
    root = tmp_path_factory.mktemp("reference")
    lines = [{"id": p, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0} for p in PROMPTS]
    path = write_requests(root / "in.jsonl", lines)
    out = root / "out.jsonl"
    run = invoke(["run", path, "-o", str(out), "--target", tiny_pair[0], "--draft", tiny_pair[1]], {})
    assert run.exit_code == 0, run.output
    records = {}
    for record in map(json.loads, out.read_text(encoding="utf-8").splitlines()):
        record["completion"] = record["completion"].replace("\x00", "\ufffd")  # the store keeps no NUL
        records[record["id"]] = record
    return records


def lines_for(name: str, count: int) -> list[dict]:
    return [
        {"id": f"{name}{i}", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0}
        for i, p in enumerate(PROMPTS[:count])
    ]


def submit(env, tmp_path, lines, tiny_pair, *args: str) -> str:
    path = write_requests(tmp_path / "in.jsonl", lines)
    return submit_job(env, path, "--target", tiny_pair[0], "--draft", tiny_pair[1], *args)


def completed(env, job_id: str) -> int:
    return job_status(env, job_id)["completed"]


def check_exactly_once(env, job_id: str, lines: list[dict], reference: dict[str, dict]) -> None:
    """Every request has one result, the counters agree, and each output is `specq run`'s, field for field."""
    info = wait_state(env, job_id, {"completed", "failed", "cancelled"}, timeout=120)
    assert (info["state"], info["completed"], info["failed"]) == ("completed", len(lines), 0), info
    db = open_database(env["SPECQ_DATABASE_URL"])
    with db.session() as session:
        results = session.scalar(select(func.count()).select_from(Result).join(Request).where(Request.job_id == job_id))
        states = request_states(session, job_id)
        tokens = session.scalars(select(Result.completion_tokens).join(Request).where(Request.job_id == job_id)).all()
        assert session.get_one(Job, job_id).generated_tokens == sum(tokens)
    assert results == len(lines) and states == {"completed": len(lines)}
    out = Path(env["SPECQ_HOME"]) / f"{job_id}.jsonl"
    assert invoke(["export", job_id, "-o", str(out)], env).exit_code == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in records] == [line["id"] for line in lines]
    keys = ("completion", "finish_reason", "prompt_tokens", "completion_tokens", "tokens")
    for line, record in zip(lines, records, strict=True):
        expected = reference[line["prompt"]]
        assert {k: record[k] for k in keys} == {k: expected[k] for k in keys}, line["id"]


def worker_logs(workers) -> str:
    return "\n".join(w.output() for w in workers)


def test_redis_restart_mid_job(fleet, private_redis, reference, tiny_pair, tmp_path) -> None:
    env, workers = fleet
    lines = lines_for("redis", 64)
    job_id = submit(env, tmp_path, lines, tiny_pair, "--batch-size", "1")  # 16 chunks of 4
    wait_for(lambda: completed(env, job_id) > 0, 60, "the first results")
    client = redis.Redis.from_url(env["SPECQ_BROKER_URL"])
    assert client.llen("specq:chunks") > 0  # chunks wait in Redis ...
    client.set("drill:marker", 1)
    private_redis.restart()
    # ... and are gone with everything else (the sweepers may already have enqueued some again, so the
    # loss is read off a key nobody writes back)
    assert not client.exists("drill:marker")
    check_exactly_once(env, job_id, lines, reference)
    assert "whose message the broker lost" in worker_logs(workers)
    for worker in workers:
        assert worker.proc.poll() is None, worker.output()  # both rode out the restart


def test_postgres_restart_mid_job(fleet, private_postgres, reference, tiny_pair, tmp_path) -> None:
    env, workers = fleet
    lines = lines_for("pg", 64)
    job_id = submit(env, tmp_path, lines, tiny_pair, "--batch-size", "1")
    wait_for(lambda: completed(env, job_id) > 0, 60, "the first results")
    private_postgres.restart()
    check_exactly_once(env, job_id, lines, reference)
    for worker in workers:
        assert worker.proc.poll() is None, worker.output()


def test_worker_killed_mid_batch_matches_specq_run(fleet, reference, tiny_pair, tmp_path) -> None:
    env, workers = fleet
    # six chunks of 8 for two workers: a worker done with its first chunk holds another while the
    # first results are stored, so the moment to kill lasts most of the job, however fast the machine
    lines = lines_for("kill", 48)
    job_id = submit(env, tmp_path, lines, tiny_pair, "--batch-size", "2")
    db = open_database(env["SPECQ_DATABASE_URL"])

    victim = wait_for(
        lambda: freeze_a_worker_mid_chunk(db, job_id, workers, len(lines)), 60, "a worker mid-chunk", poll=0.02
    )
    victim.stop(signal.SIGKILL)
    check_exactly_once(env, job_id, lines, reference)  # `specq run`'s outputs, exactly once

    def victim_state() -> str:
        listed = {w["pid"]: w for w in json.loads(invoke(["workers", "--all", "--json"], env).stdout)}
        return listed[victim.proc.pid]["state"]

    # "lost" once its last heartbeat is a lease old; the job may end a moment sooner, as the leases it
    # renewed just before that heartbeat expire first
    wait_for(lambda: victim_state() == "lost", 10, "the killed worker listed as lost")
    live = json.loads(invoke(["workers", "--json"], env).stdout)
    assert victim.proc.pid not in [w["pid"] for w in live] and live
    with db.session() as session:
        assert session.scalar(select(func.max(Request.attempts)).where(Request.job_id == job_id)) == 2
