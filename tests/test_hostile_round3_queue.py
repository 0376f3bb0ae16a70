"""Issue 49, the queue's part, through real `specq worker` subprocesses, Redis and PostgreSQL:

- item 4: a chunk message naming another database is set aside (dead-lettered) by the first worker that
  takes it, which keeps serving; the count shows in `specq workers` and in the worker's metrics; a client
  on another database than the live workers' is told at submit, and nothing is stored;
- item 10: an embedded `submit` (no services: SQLite) shows its progress while it runs in the
  foreground, and exits 1 when the job is cancelled from another process, as a cancelled `--wait` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import redis
from sqlalchemy import func, select

from specq.db.migrate import open_migrated
from specq.db.models import Job, Request
from specq.db.states import RequestState
from specq.queue import CHUNK_QUEUE_KEY, DEAD_LETTER_KEY, DEAD_LETTERED_KEY, SERVING_KEY_PREFIX
from tests.private_servers import free_port
from tests.services import (
    create_database,
    drop_database,
    invoke,
    request_states,
    services_env,
    submit_job,
    wait_state,
    write_requests,
)

LINES = [{"id": f"q{i}", "prompt": f"def f{i}(a, b):", "max_tokens": 4, "temperature": 0} for i in range(2)]
ENDED = {"completed", "failed", "cancelled"}


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def test_a_message_for_another_database_is_set_aside_once_and_the_worker_keeps_serving(
    pg_db_url, redis_url, tiny_pair, tmp_path, start_worker
) -> None:
    """Before: the worker gave the chunk back and exited 4, the next worker took it and exited 4, for ever.
    Now the first worker sets it aside and acknowledges it, then runs the fleet's own job; the foreign
    job's requests stay queued in their database, untouched."""
    other_name = f"specq_test_foreign_{os.getpid()}"
    other_url = create_database(other_name)
    try:
        open_migrated(other_url)
        fleet = services_env(pg_db_url, redis_url, tmp_path / "home")
        foreign = services_env(other_url, redis_url, tmp_path / "home")
        path = write_requests(tmp_path / "in.jsonl", LINES)
        # no worker is live yet: nothing to compare with, so the foreign client's submit goes through
        foreign_job = submit_job(foreign, path, "--target", tiny_pair[0])
        own_job = submit_job(fleet, path, "--target", tiny_pair[0])

        port = free_port()
        worker = start_worker(fleet, metrics_port=port)
        info = wait_state(fleet, own_job, ENDED, timeout=120)  # its message was behind the foreign one
        assert (info["state"], info["completed"]) == ("completed", len(LINES)), info
        assert worker.proc.poll() is None, worker.output()  # still serving
        assert "exited" not in worker.output()

        client = redis.Redis.from_url(redis_url)
        (entry,) = [json.loads(raw) for raw in client.lrange(DEAD_LETTER_KEY, 0, -1)]
        assert (entry["job_id"], entry["first"], entry["end"]) == (foreign_job, 0, len(LINES))
        assert entry["database"].endswith(f"/{other_name}") and "postgres" not in entry["database"].split("/")[0]
        assert int(client.get(DEAD_LETTERED_KEY) or 0) == 1
        assert client.llen(CHUNK_QUEUE_KEY) == 0  # not given back: no other worker takes it in turn
        assert f"job {foreign_job} chunk [0, {len(LINES)}) is in database '{other_name}'" in worker.output()
        with open_migrated(other_url).session() as session:  # the foreign job waits, whole, in its database
            assert request_states(session, foreign_job) == {RequestState.QUEUED: len(LINES)}

        listed = invoke(["workers", "--json"], fleet)
        assert listed.exit_code == 0, listed.output
        (shown,) = json.loads(listed.stdout)
        assert shown["dead_lettered"] == 1, shown
        table = invoke(["workers"], {**fleet, "COLUMNS": "250"})
        assert table.exit_code == 0, table.output
        assert "set aside" in table.stdout.splitlines()[0]
        assert "1 chunk message named another database than the workers' and was set aside" in table.stderr
        assert 'specq_chunks_dead_lettered_total{device="cpu"} 1.0' in _scrape(port)

        # the foreign client is told now, in one line, and nothing more is stored in its database
        refused = invoke(["submit", path, "--target", tiny_pair[0]], foreign)
        assert refused.exit_code == 1, refused.output
        (line,) = refused.stderr.strip().splitlines()
        assert line.startswith("Error: the 1 live worker on the broker at redis://") and "serve database '" in line
        assert f"not this job's database '{other_name}'" in line and "nothing was stored" in line, line
        with open_migrated(other_url).session() as session:
            assert session.scalar(select(func.count()).select_from(Job)) == 1
            assert session.scalar(select(func.count()).select_from(Request)) == len(LINES)
        assert submit_job(fleet, path, "--target", tiny_pair[0])  # the fleet's own client is not refused
    finally:
        drop_database(other_name)


def test_a_stopped_worker_leaves_no_entry_and_a_refused_submit_needs_a_live_one(
    pg_db_url, redis_url, tiny_pair, tmp_path, start_worker
) -> None:
    """A worker's entry on the broker lives while it does: gone at its stop, so a client of another
    database is refused only while a worker of another database is live."""
    other_name = f"specq_test_foreign2_{os.getpid()}"  # not the one above: migrated once per process
    other_url = create_database(other_name)
    try:
        open_migrated(other_url)
        fleet = services_env(pg_db_url, redis_url, tmp_path / "home")
        foreign = services_env(other_url, redis_url, tmp_path / "home")
        path = write_requests(tmp_path / "in.jsonl", LINES[:1])
        worker = start_worker(fleet)
        client = redis.Redis.from_url(redis_url)
        (key,) = client.keys(SERVING_KEY_PREFIX + "*")
        assert 0 < client.ttl(key) <= 45  # expires with the heartbeat (lease_s by default)
        assert invoke(["submit", path, "--target", tiny_pair[0]], foreign).exit_code == 1
        assert worker.stop() == 0
        assert client.keys(SERVING_KEY_PREFIX + "*") == []
        assert submit_job(foreign, path, "--target", tiny_pair[0])  # no live worker: nothing to compare
    finally:
        drop_database(other_name)


def test_a_cancelled_embedded_submit_exits_1_and_shows_its_progress(tiny_pair, tmp_path, monkeypatch) -> None:
    """No services (SQLite in the data directory): `submit` runs the job in the foreground. `specq cancel`
    from another process, once the first result is stored: before, the submit printed no progress and
    exited 0; now progress lines, the summary, and exit 1."""
    import specq.cli.progress
    import specq.worker.chunk as chunk

    monkeypatch.setattr(specq.cli.progress, "PLAIN_EVERY_S", 0.0)  # a line per poll, whatever the speed
    monkeypatch.setattr(chunk, "FLUSH_SECONDS", 0.0)  # every result stored as it comes
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    env.update(SPECQ_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    cancels: list[subprocess.CompletedProcess[str]] = []
    flush = chunk._Writer.flush

    def cancel_after_the_first_result(self, batch=None):
        flush(self, batch)  # committed: the other process sees it
        if self.written and not cancels:
            command = [sys.executable, "-c", "from specq.cli.main import main; main()", "cancel", self.job_id]
            cancels.append(subprocess.run(command, env=env, capture_output=True, text=True, timeout=300))

    monkeypatch.setattr(chunk._Writer, "flush", cancel_after_the_first_result)
    lines = [{"id": f"q{i}", "prompt": f"def f{i}(x):", "max_tokens": 4, "temperature": 0} for i in range(6)]
    path = write_requests(tmp_path / "in.jsonl", lines)
    result = invoke(["submit", path, "--target", tiny_pair[0], "--batch-size", "1"], env)
    assert cancels and cancels[0].returncode == 0, cancels and cancels[0].stderr
    job_id = result.stdout.strip()
    assert result.exit_code == 1, result.output
    progress = [line for line in result.stderr.splitlines() if line.startswith(f"job {job_id}: 0/6 done, ")]
    assert progress, result.stderr  # the first poll, before the first result: shown while it runs
    assert f"job {job_id} cancelled: " in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"Error: job {job_id} cancelled"), result.stderr
