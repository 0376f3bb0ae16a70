"""Hardening: the queue takes JSON only, credentials never show, inputs have limits with clear errors.

- A pickle-serialized task, published by hand on the real Redis queue, is refused by a real worker:
  it is never unpickled (its payload would create a file), no task runs, nothing is claimed or stored,
  and the worker logs the refusal.
- The same worker runs with a password in both URLs (a Redis ACL user; PostgreSQL here trusts any
  password): no log line holds the password, the URLs show as `user:***@`; so do `specq db upgrade`,
  `specq workers` and the errors of every command.
- A line over the line limit, and a file over the file limit, stop `submit` and `run` with
  `INPUT:LINE:` / `INPUT:` errors (exit 2) and store nothing. A request too long for the model's
  context fails alone (tests/test_queue.py and tests/test_queue_embedded.py show it).
"""

from __future__ import annotations

import json
import os
import uuid

import pytest
import redis
from sqlalchemy import func, select

from specq.db.models import Job, Request, Result
from specq.queue import CHUNK_QUEUE, PROCESS_CHUNK_TASK
from tests.fleet_helpers import wait_for
from tests.services import REDIS_TEST_URL, SpecqWorker, count_rows, invoke, services_env, write_requests

PASSWORD = "hunter2-s3cret"
USER = "specq_hardening"
PLAIN = {"id": "p1", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}


@pytest.fixture
def secret_urls(pg_db_url, redis_url):
    """(database URL, broker URL), each with a password: a Redis ACL user made for the test."""
    client = redis.Redis.from_url(REDIS_TEST_URL)
    client.execute_command("ACL", "SETUSER", USER, "reset", "on", f">{PASSWORD}", "~*", "&*", "+@all")
    try:
        db_url = pg_db_url.replace("://postgres@", f"://postgres:{PASSWORD}@", 1)
        broker = REDIS_TEST_URL.replace("redis://", f"redis://{USER}:{PASSWORD}@", 1)
        yield db_url, broker
    finally:
        client.execute_command("ACL", "DELUSER", USER)
        client.close()


class Boom:
    """Unpickling this runs a shell command: the proof that a worker unpickled something."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def publish_pickle(broker: str, job_id: str, marker: str) -> None:
    """A Celery protocol-2 task message for a real chunk, its body pickled, put on the real queue."""
    from specq.worker.app import configure

    app = configure(broker)
    task_id = str(uuid.uuid4())
    headers = {
        "lang": "py",
        "task": PROCESS_CHUNK_TASK,
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "group": None,
        "retries": 0,
        "eta": None,
        "expires": None,
        "timelimit": [None, None],
        "argsrepr": repr((job_id, 0, 1)),
        "kwargsrepr": "{}",
        "origin": "test",
    }
    body = ((job_id, 0, 1), {"payload": Boom(marker)}, {"callbacks": None, "errbacks": None, "chain": None})
    with app.connection_for_write() as conn:
        producer = conn.Producer(serializer="pickle")
        producer.publish(body, exchange="", routing_key=CHUNK_QUEUE, headers=headers, correlation_id=task_id)


def test_pickle_refused_and_credentials_masked(secret_urls, tiny_pair, tmp_path) -> None:
    db_url, broker = secret_urls
    env = services_env(db_url, broker, tmp_path / "home")
    # a job stored but not enqueued (no broker for the submit): only the pickle message will name it
    path = write_requests(tmp_path / "in.jsonl", [PLAIN])
    from specq.decoding.config import DecodingConfig
    from specq.jobs.settings import JobSettings
    from specq.jobs.submit import JobSpec, submit_job

    spec = JobSpec(target=tiny_pair[0], draft=None, settings=JobSettings(decoding=DecodingConfig(batch_size=1)))
    job_id = submit_job(path, spec, database_url=db_url, broker=None, models_checked=True).job_id

    worker = SpecqWorker(env, tmp_path / "worker.log").wait_ready()
    try:
        marker = tmp_path / "unpickled"
        publish_pickle(broker, job_id, str(marker))
        wait_for(lambda: "Refusing to deserialize" in worker.output(), 30, "the refusal in the worker log")
        assert redis.Redis.from_url(REDIS_TEST_URL).llen(f"specq:{CHUNK_QUEUE}") == 0  # taken off, not requeued
        result = invoke(["workers", "--json"], env)
        assert result.exit_code == 0, result.output
        (listed,) = json.loads(result.stdout)
        assert listed["state"] == "idle"
    finally:
        assert worker.stop() == 0
    log = worker.output()
    assert "untrusted content of type pickle" in log
    assert not marker.exists()  # never unpickled
    assert "] received" not in log and "succeeded" not in log  # no task was accepted, none ran
    with open_db(db_url).session() as session:
        assert session.scalar(select(func.count()).select_from(Result)) == 0
        request = session.scalar(select(Request).where(Request.job_id == job_id))
        assert (request.state, request.attempts, request.starts) == ("queued", 0, 0)

    # no password anywhere; Celery's own masked form (user:**@) is rewritten as specq's user:***@
    assert PASSWORD not in log and f"{USER}:***@" in log and "postgres:***@" in log
    for args in (["db", "upgrade"], ["workers"], ["status"], ["status", job_id, "--json"]):
        result = invoke(args, env)
        assert result.exit_code == 0, result.output
        assert PASSWORD not in result.output
    assert "postgres:***@" in invoke(["db", "upgrade"], env).output
    down = services_env(
        db_url.replace(":5432/", ":1/"), broker.replace(":6379/", ":1/"), tmp_path / "home", SPECQ_OUTAGE_PATIENCE_S="0"
    )
    for args in (["status"], ["workers", "--json"], ["worker"], ["submit", path, "--target", tiny_pair[0]]):
        result = invoke(args, down)
        assert result.exit_code == 1 and PASSWORD not in result.output and "***" in result.output, result.output


def open_db(url):
    from specq.db.session import open_database

    return open_database(url)


def test_line_and_file_limits(pg_db_url, redis_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    huge = {"id": "big", "prompt": "x" * (1 << 20), "max_tokens": 4}
    path = write_requests(tmp_path / "in.jsonl", [PLAIN, huge, {**PLAIN, "id": "p3"}, "{oops"])
    result = invoke(["submit", path, "--target", tiny_pair[0]], env)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[:2] == [
        f"{path}:2: the line is longer than 1048576 bytes (the limit; raise it with --max-line-bytes or "
        "SPECQ_MAX_LINE_BYTES)",
        f"{path}:4: not valid JSON: Expecting property name enclosed in double quotes (column 2)",
    ]
    small = write_requests(tmp_path / "small.jsonl", [PLAIN, {**PLAIN, "id": "p2", "prompt": "y" * 100}])
    result = invoke(["submit", small, "--target", tiny_pair[0], "--max-line-bytes", "80"], env)
    assert result.exit_code == 2 and f"{small}:2: the line is longer than 80 bytes" in result.output
    result = invoke(["submit", small, "--target", tiny_pair[0]], {**env, "SPECQ_MAX_INPUT_BYTES": "100"})
    assert result.exit_code == 2, result.output
    assert f"{small}: the file is {os.path.getsize(small)} bytes, over the limit of 100" in result.output
    result = invoke(["run", small, "-o", str(tmp_path / "o.jsonl"), "--target", tiny_pair[0], "--max-line-bytes", "80"])
    assert result.exit_code == 2 and f"{small}:2: the line is longer than 80 bytes" in result.output
    assert count_rows(pg_db_url, Job) == 0 and count_rows(pg_db_url, Request) == 0
    assert redis.Redis.from_url(redis_url).llen(f"specq:{CHUNK_QUEUE}") == 0
