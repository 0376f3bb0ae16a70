"""A worker killed mid-batch costs time, never a result: its leases expire, another worker's sweeper
puts its requests back, and every request still ends with exactly one result."""

from __future__ import annotations

import json
import signal
import time

from sqlalchemy import func, select

from db.models import Request, Result
from db.session import open_database
from tests.fleet_helpers import DRILL_ENV
from tests.services import invoke, reference_greedy, services_env, submit_job, wait_state, write_requests


def test_worker_killed_mid_batch(pg_db_url, redis_url, start_worker, tiny_pair, tmp_path) -> None:
    # short leases and sweeps, so the dead worker's requests come back within seconds
    env = services_env(pg_db_url, redis_url, tmp_path / "home", **DRILL_ENV)
    workers = [start_worker(env), start_worker(env)]
    lines = [{"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 60, "temperature": 0} for i in range(8)]
    path = write_requests(tmp_path / "in.jsonl", lines)
    args = ("--target", tiny_pair[0], "--draft", tiny_pair[1], "--batch-size", "2")
    job_id = submit_job(env, path, *args)  # 8 requests: one chunk, so one worker has it all

    db = open_database(pg_db_url)
    deadline = time.monotonic() + 60
    owner = None
    while owner is None:  # the holder, once it is mid-chunk: something claimed, something written
        with db.session() as session:
            owner = session.scalar(select(Request.lease_owner).where(Request.state == "running").limit(1))
            done = session.scalar(select(func.count()).select_from(Result))
        if owner is not None and not 0 < done < len(lines):
            owner = None
        assert time.monotonic() < deadline, "no worker took the chunk"
        time.sleep(0.02)
    victim = next(w for w in workers if owner.endswith(f":{w.proc.pid}"))
    victim.stop(signal.SIGKILL)

    info = wait_state(env, job_id, {"completed", "failed"}, timeout=90)
    assert (info["state"], info["completed"], info["failed"]) == ("completed", len(lines), 0)
    with db.session() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == len(lines)
        assert session.scalar(select(func.max(Request.attempts))) == 2  # the dead worker's requests ran again
    out = tmp_path / "out.jsonl"
    assert invoke(["export", job_id, "-o", str(out)], env).exit_code == 0
    expected = reference_greedy(tiny_pair[0], lines)
    for record in map(json.loads, out.read_text(encoding="utf-8").splitlines()):
        assert record["tokens"] == expected[record["id"]]
