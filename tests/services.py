"""Helpers for tests that talk to the real services and CLI.

Real services: a throwaway PostgreSQL database per test session (see conftest's `pg_url`), Redis
database 15 (or the next free one: `_redis_test_url`), real `specq worker` subprocesses and `specq`
commands run in-process. Nothing is mocked.
benchmarks/load_run.py runs its jobs with the same helpers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fleet_helpers import patience

PG_ADMIN_URL = os.environ.get("SPECQ_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")


# Written into every Redis database the suite empties: a database that holds keys but not this one is
# somebody else's, and the suite refuses to flush it.
REDIS_OWNER_KEY = "specq-test-suite:owned"
REDIS_DATABASES = 16  # a Redis server's default `databases`: the suite looks for a free one among 0..15


def _with_db(url: str, db: int) -> str:
    from urllib.parse import urlsplit, urlunsplit

    return urlunsplit(urlsplit(url)._replace(path=f"/{db}"))


def _redis_db_is_free(url: str) -> bool:
    """Empty, or marked as the suite's: a database the suite may flush. redis.RedisError when no server answers."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        return not client.dbsize() or bool(client.exists(REDIS_OWNER_KEY))
    except redis.ResponseError:  # "DB index is out of range": a server configured with fewer databases
        return False
    finally:
        client.close()


def choose_redis_test_url(url: str, worker: int, databases: int = REDIS_DATABASES) -> str | None:
    """The database of `url`'s server that pytest-xdist worker `worker` (gw0: 0) uses, or None when there is
    none free for it; redis.RedisError when no server answers.

    The free databases (empty or the suite's), taken in the order url's db, one lower, ... wrapping round,
    the n-th for worker gwn: every worker reads the same order, so each takes another database with no
    word between them, and with all free that is url's db for gw0, one lower for gw1, ... as it always was.
    A database holding somebody else's keys (another user's queue) is passed over, never flushed.
    """
    free = [candidate for candidate in _redis_db_order(url, databases) if _redis_db_is_free(candidate)]
    return free[worker] if worker < len(free) else None


def _redis_db_order(url: str, databases: int = REDIS_DATABASES) -> list[str]:
    """url's database, then one lower, ... wrapping round: the order the suite takes them in."""
    from urllib.parse import urlsplit

    first = int(urlsplit(url).path.strip("/") or 0)
    return [_with_db(url, (first - step) % databases) for step in range(databases)]


def _private_redis_url() -> str:
    """Database 0 of a redis-server of this process's own, stopped and removed when the process ends."""
    import atexit
    import shutil
    import tempfile

    from tests.private_servers import PrivateRedis

    server = PrivateRedis(Path(tempfile.mkdtemp(prefix="specq-test-redis-")))
    server.start()
    atexit.register(shutil.rmtree, server.root, ignore_errors=True)
    atexit.register(server.stop)  # atexit runs last-registered first: stopped, then its folder removed
    return server.url(0)


def _redis_test_url() -> str:
    """The Redis database this test process uses: SPECQ_TEST_REDIS_URL's (default db 15) server, one db
    lower for each further pytest-xdist worker (gw1: 14, ...), so that parallel workers never flush each
    other's keys or take each other's tasks; databases holding somebody else's keys are passed over
    (choose_redis_test_url), and with none left a private redis-server is started. Chosen once, at import:
    every fixture, CLI call and `specq worker` subprocess of the process gets this one URL."""
    import redis

    url = os.environ.get("SPECQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    try:
        chosen = choose_redis_test_url(url, worker)
    except redis.RedisError:  # no server: the tests that need one skip, naming this URL
        return _redis_db_order(url)[worker % REDIS_DATABASES]
    if chosen is not None:
        return chosen
    try:
        return _private_redis_url()
    except (FileNotFoundError, subprocess.SubprocessError, AssertionError):
        # no redis-server to start: a database of somebody else's, which flushed_redis refuses naming it,
        # rather than one that another worker of this run already uses
        return next((db for db in _redis_db_order(url) if not _redis_db_is_free(db)), url)


REDIS_TEST_URL = _redis_test_url()
_TABLES = ("results", "batches", "requests", "workers", "jobs")


def empty_database(db_url):
    """Migrate the database at `db_url` and empty every table of specq's."""
    from sqlalchemy import text

    from specq.db.migrate import open_migrated

    db = open_migrated(db_url)
    with db.engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(_TABLES)} RESTART IDENTITY CASCADE"))


def database_url(name, admin_url=PG_ADMIN_URL):
    """The SQLAlchemy URL of database `name` on the server of `admin_url`."""
    base = admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{base}/{name}"


def create_database(name, admin_url=PG_ADMIN_URL):
    """A new, empty PostgreSQL database `name` (one of that name left by a killed run is dropped first);
    its SQLAlchemy URL. psycopg.OperationalError when no server answers within 3 s."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True, connect_timeout=3) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    return database_url(name, admin_url)


def drop_database(name, admin_url=PG_ADMIN_URL):
    """Close this process's connections to database `name`, then drop it, cutting any other client's."""
    import psycopg

    from specq.db.session import dispose_all

    dispose_all()
    with psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class ForeignRedisData(RuntimeError):
    """The Redis database the suite was pointed at holds keys the suite did not write."""


def flush_redis(url=REDIS_TEST_URL):
    """A client of the Redis database at `url`, emptied, with the suite's ownership mark in it;
    redis.RedisError when no server answers, ForeignRedisData (nothing touched) when the database holds
    keys the suite did not write."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    if client.dbsize() and not client.exists(REDIS_OWNER_KEY):
        client.close()
        raise ForeignRedisData(
            f"the Redis database at {url} holds keys that the test suite did not write: it is left as it is. "
            "Point SPECQ_TEST_REDIS_URL at an empty database (e.g. redis://127.0.0.1:6379/13)"
        )
    client.flushdb()
    client.set(REDIS_OWNER_KEY, "1")
    return client


def flushed_redis(url=REDIS_TEST_URL):
    """A client of the Redis database at `url`, emptied (see flush_redis); the test is skipped when no
    server answers, and fails when the database is somebody else's."""
    import redis

    try:
        return flush_redis(url)
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {url}: {exc}")
    except ForeignRedisData as exc:
        pytest.fail(str(exc), pytrace=False)


def write_requests(path, lines):
    """Write JSONL: dicts are JSON-encoded, strings written as they are."""
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return str(path)


class SpecqWorker:
    """A real `specq worker` subprocess, logging to a file."""

    def __init__(self, env, log_path, device="cpu", metrics_port=None, args=()):
        args = [sys.executable, "-c", "from specq.cli.main import main; main()", "worker", "--device", device, *args]
        args += ["--metrics-port", str(metrics_port or 0)]  # 0: none, so parallel test workers never collide
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def output(self):
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout=60.0):
        timeout = patience(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.output()}")
            if " ready." in self.output():
                return self
            time.sleep(0.2)
        raise RuntimeError(f"worker not ready after {timeout}s:\n{self.output()}")

    def stop(self, sig=signal.SIGTERM, timeout=60.0):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def services_env(db_url, broker, home, **extra):
    """The environment of a CLI call or worker process: these services, no other SPECQ_ setting."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    env.update(SPECQ_DATABASE_URL=db_url, SPECQ_HOME=str(home), OMP_NUM_THREADS="1")
    env.update(extra)  # may set OMP_NUM_THREADS too
    if broker:
        env["SPECQ_BROKER_URL"] = broker
    return env


def invoke(args, env=None, stdin=None):
    """`specq ARGS` in-process (click's CliRunner), fed `stdin` (bytes); stdout and stderr apart in
    .stdout / .stderr."""
    from click.testing import CliRunner

    from specq.cli.main import _register, cli

    _register()
    return CliRunner().invoke(cli, args, env=env, input=stdin, catch_exceptions=False)


def run_alone_and_with_draft(target, draft, tmp_path, max_tokens=24):
    """`specq run` of one greedy prompt by the target alone and with `--draft DRAFT`: the two output records."""
    requests = write_requests(tmp_path / "in.jsonl", [{"id": "a", "prompt": "def mul(a, b):", "temperature": 0}])
    outputs = []
    for name, draft_args in (("alone", []), ("drafted", ["--draft", str(draft)])):
        out = tmp_path / f"{name}.jsonl"
        ran = invoke(
            ["run", requests, "-o", str(out), "--target", target, "--max-tokens", str(max_tokens), *draft_args]
        )
        assert ran.exit_code == 0, ran.output
        outputs.append(json.loads(out.read_text()))
    return outputs


def submit_job(env, path, *args):
    """`specq submit PATH ARGS`, which must succeed; the job id it prints."""
    result = invoke(["submit", path, *args], env)
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def count_rows(db_url, model):
    from sqlalchemy import func, select

    from specq.db.session import open_database

    with open_database(db_url).session() as session:
        return session.scalar(select(func.count()).select_from(model)) or 0


def request_states(session, job_id):
    """{state: how many of the job's requests are in it}."""
    from sqlalchemy import func, select

    from specq.db.models import Request

    query = select(Request.state, func.count()).where(Request.job_id == job_id).group_by(Request.state)
    return dict(session.execute(query).all())


def job_status(env, job_id):
    result = invoke(["status", job_id, "--json"], env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def wait_state(env, job_id, states, timeout=90.0):
    """Poll `specq status` until the job is in one of `states`; its status."""
    timeout = patience(timeout)
    deadline = time.monotonic() + timeout
    while True:
        info = job_status(env, job_id)
        if info["state"] in states:
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {info['state']} after {timeout}s")
        time.sleep(0.3)


def reference_greedy(target_dir, lines):
    """{id: token ids} of the greedy lines, from the engine run directly on the target alone, one
    request at a time: what any batching, any draft and any worker must reproduce exactly."""
    from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
    from specq.models.loading import load_pair, tokenize_prompt

    pair = load_pair(target_dir, None, "cpu", None)
    engine = SpeculativeEngine(pair.target, pair.tokenizer, None, DecodingConfig(batch_size=1))
    out = {}
    for number, line in enumerate(lines, start=1):
        body = line.get("body", line)
        if body.get("temperature") != 0:
            continue
        ids = tokenize_prompt(pair.tokenizer, prompt=body.get("prompt"), messages=body.get("messages"))
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=0.0)
        (result,) = engine.generate([GenerationRequest(0, tuple(ids), params)])
        out[str(line.get("id") or line.get("custom_id") or number)] = result.token_ids
    return out
