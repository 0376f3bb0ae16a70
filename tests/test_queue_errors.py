"""Every error path of the queue commands: exit 2 for bad usage and input, 1 for services down, one
sentence and no traceback, passwords masked, and nothing stored or enqueued. Real PostgreSQL and Redis,
no worker (cancel and retry are checked on the store and the queue directly)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from specq.db.models import Job, Request, Result
from specq.queue import CHUNK_QUEUE_KEY
from tests.services import count_rows, invoke, job_status, services_env, submit_job, write_requests

PLAIN = {"id": "p1", "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}


@pytest.fixture
def env(pg_db_url, redis_url, tmp_path):
    return services_env(pg_db_url, redis_url, tmp_path / "home")


def queued_tasks(env) -> int:
    return redis.Redis.from_url(env["SPECQ_BROKER_URL"]).llen(CHUNK_QUEUE_KEY)


def assert_nothing_stored(env) -> None:
    assert count_rows(env["SPECQ_DATABASE_URL"], Job) == 0
    assert count_rows(env["SPECQ_DATABASE_URL"], Request) == 0
    assert queued_tasks(env) == 0


def test_bad_lines_all_reported_nothing_stored(env, tiny_pair, tmp_path) -> None:
    lines = [PLAIN, "{oops", {"prompt": 5}, PLAIN, {"id": "x", "prompt": "a", "temperature": 3}]
    path = write_requests(tmp_path / "bad.jsonl", lines)
    result = invoke(["submit", path, "--target", tiny_pair[0]], env)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"{path}:2: not valid JSON: Expecting property name enclosed in double quotes (column 2)",
        f'{path}:3: "prompt" must be a string, got number',
        f'{path}:4: duplicate id "p1" (first on line 1)',
        f'{path}:5: "temperature" must be in [0, 2], got 3',
        "Error: 4 bad lines; nothing was done",
    ]
    assert_nothing_stored(env)


def test_empty_file_is_bad_input(env, tiny_pair, tmp_path) -> None:
    path = write_requests(tmp_path / "empty.jsonl", ["", "  "])
    result = invoke(["submit", path, "--target", tiny_pair[0]], env)
    assert result.exit_code == 2 and f"{path}: the file has no requests" in result.output
    assert_nothing_stored(env)


def test_models_fail_early(env, tiny_pair, tmp_path) -> None:
    from transformers import AutoTokenizer

    path = write_requests(tmp_path / "in.jsonl", [PLAIN])
    result = invoke(["submit", path, "--target", str(tmp_path / "no-such-model")], env)
    assert result.exit_code == 2, result.output
    assert "no folder exists at" in result.output and "Traceback" not in result.output

    other = AutoTokenizer.from_pretrained(tiny_pair[0])  # a draft whose vocabulary differs by one token
    other.add_tokens(["<extra_token>"])
    other.save_pretrained(tmp_path / "other")
    (tmp_path / "other" / "config.json").write_text((Path(tiny_pair[1]) / "config.json").read_text())
    result = invoke(["submit", path, "--target", tiny_pair[0], "--draft", str(tmp_path / "other")], env)
    assert result.exit_code == 2, result.output
    assert "does not share the vocabulary" in result.output

    result = invoke(["submit", path], env)  # no --target and no SPECQ_TARGET
    assert result.exit_code == 2 and "--target" in result.output
    assert_nothing_stored(env)


def test_model_check_beside_the_read_in_a_fresh_process(env, tiny_pair, tmp_path) -> None:
    """The `specq` process has not imported transformers: the model check runs in a child while the file
    is read. A bad model wins over bad lines; a good one lets the bad lines be reported; nothing stored."""
    path = write_requests(tmp_path / "bad.jsonl", [PLAIN, "{oops"])
    specq = [sys.executable, "-c", "from specq.cli.main import main; main()", "submit", path]
    bad_model = subprocess.run([*specq, "--target", str(tmp_path / "nope")], env=env, capture_output=True, text=True)
    assert bad_model.returncode == 2, bad_model.stderr
    assert "no folder exists at" in bad_model.stderr and "not valid JSON" not in bad_model.stderr
    bad_line = subprocess.run([*specq, "--target", tiny_pair[0]], env=env, capture_output=True, text=True)
    assert bad_line.returncode == 2 and f"{path}:2: not valid JSON" in bad_line.stderr
    assert_nothing_stored(env)
    good = write_requests(tmp_path / "good.jsonl", [PLAIN])
    done = subprocess.run([*specq[:-1], good, "--target", tiny_pair[0]], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert count_rows(env["SPECQ_DATABASE_URL"], Request) == 1


def test_broker_down_stores_nothing(pg_db_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, "redis://:hunter2@127.0.0.1:1/0", tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", [PLAIN])
    result = invoke(["submit", path, "--target", tiny_pair[0]], env)
    assert result.exit_code == 1, result.output
    assert "cannot reach the broker at redis://:***@127.0.0.1:1/0" in result.output
    assert "hunter2" not in result.output and "Traceback" not in result.output
    assert count_rows(pg_db_url, Job) == 0
    result = invoke(["worker"], env)
    assert result.exit_code == 1 and "hunter2" not in result.output


def test_database_down_every_command(redis_url, tiny_pair, tmp_path) -> None:
    env = services_env(
        "postgresql+psycopg://postgres:hunter2@127.0.0.1:1/specq",
        redis_url,
        tmp_path / "home",
        SPECQ_OUTAGE_PATIENCE_S="0",  # no riding out the outage (tests/test_outages.py does)
    )
    path = write_requests(tmp_path / "in.jsonl", [PLAIN])
    for args in (
        ["submit", path, "--target", tiny_pair[0]],
        ["status"],
        ["status", "abc", "--json"],
        ["export", "abc", "-o", str(tmp_path / "x.csv")],
        ["cancel", "abc"],
        ["retry", "abc"],
        ["workers", "--json"],
        ["worker"],
        ["db", "upgrade"],
    ):
        result = invoke(args, env)
        assert result.exit_code == 1, (args, result.output)
        assert "cannot reach the database at postgresql+psycopg://postgres:***@127.0.0.1:1/specq" in result.output
        assert "hunter2" not in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


def test_unknown_job_and_usage_errors(env, tmp_path) -> None:
    for args in (
        ["status", "nope"],
        ["export", "nope", "-o", str(tmp_path / "x.csv")],
        ["cancel", "nope"],
        ["retry", "nope"],
    ):
        result = invoke(args, env)
        assert result.exit_code == 2, (args, result.output)
        assert "no job has the id 'nope'" in result.output
    assert invoke(["export", "nope"], env).exit_code == 2  # -o is required
    assert invoke(["export", "x", "-o", "y", "--format", "xml"], env).exit_code == 2
    result = invoke(["worker"], {**env, "SPECQ_BROKER_URL": ""})
    assert result.exit_code == 2 and "needs a broker" in result.output
    result = invoke(["submit", str(tmp_path / "missing.jsonl"), "--target", "t"], env)
    assert result.exit_code == 2 and "does not exist" in result.output
    result = invoke(["submit", str(tmp_path), "--target", "t"], env)
    assert result.exit_code == 2  # a folder is not an input file
    result = invoke(["submit", "x", "--target", "t", "--temperature", "3"], env)
    assert result.exit_code == 2


def test_cancel_and_retry_on_the_store_and_queue(env, tiny_pair, tmp_path) -> None:
    lines = [{"prompt": f"def f{i}():", "max_tokens": 4} for i in range(10)]
    path = write_requests(tmp_path / "in.jsonl", lines)
    job_id = submit_job(env, path, "--target", tiny_pair[0], "--batch-size", "1")
    assert queued_tasks(env) == 3  # 10 requests in chunks of 4 (4 batches of 1)
    assert job_status(env, job_id)["state"] == "queued"

    result = invoke(["cancel", job_id], env)
    assert result.exit_code == 0 and "10 queued requests will not run" in result.output
    assert job_status(env, job_id)["state"] == "cancelled"
    out = tmp_path / "cancelled.csv"
    assert invoke(["export", job_id, "-o", str(out)], env).exit_code == 0
    assert out.read_text(encoding="utf-8").count(",cancelled,") == 10
    again = invoke(["cancel", job_id], env)
    assert again.exit_code == 0 and "already cancelled" in again.output

    redis.Redis.from_url(env["SPECQ_BROKER_URL"]).delete(CHUNK_QUEUE_KEY)
    result = invoke(["retry", job_id], env)
    assert result.exit_code == 0, result.output
    assert "10 requests requeued" in result.output
    assert queued_tasks(env) == 3
    info = job_status(env, job_id)
    assert (info["state"], info["completed"], info["failed"]) == ("queued", 0, 0)
    assert count_rows(env["SPECQ_DATABASE_URL"], Result) == 0


def test_help_needs_no_services_and_no_torch() -> None:
    bad = {"SPECQ_DATABASE_URL": "postgresql+psycopg://x@127.0.0.1:1/x", "SPECQ_BROKER_URL": "redis://127.0.0.1:1/0"}
    code = "import sys; from specq.cli.main import main; sys.argv = ['specq', '--help']; main()"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **bad}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for command in ("submit", "status", "export", "cancel", "retry", "worker", "workers", "db"):
        assert f"  {command} " in done.stdout, command
    probe = (
        "import sys, specq.cli.main; specq.cli.main._register(); "
        "print('torch' in sys.modules, 'sqlalchemy' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.stdout.split() == ["False", "False"], done.stderr


def test_celery_is_json_only_late_ack_prefetch_one() -> None:
    from specq.queue import KEY_PREFIX, QueueSettings
    from specq.worker.app import app

    conf = app.conf
    assert (conf.task_serializer, conf.result_serializer) == ("json", "json")
    assert list(conf.accept_content) == ["json"]
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    options = conf.broker_transport_options
    assert options["global_keyprefix"] == KEY_PREFIX == "specq:"
    queue = QueueSettings.from_env()
    assert options["visibility_timeout"] == queue.visibility_timeout_s > queue.lease_s
