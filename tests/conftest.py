"""Shared test fixtures.

The demo model pair is built once per machine into specq's data directory (a few CPU minutes the first
time, then read from the cache). Session-scoped fixtures are set up before the function-scoped
`_specq_isolated_env`, so that build lands in the user's data dir (or $SPECQ_HOME), not a test tmp dir.

Storage and queue fixtures use the real services: a throwaway PostgreSQL database per test session
(specq_test_<pid>, dropped at the end), Redis database 15 flushed around each test, real `specq worker`
subprocesses. Nothing is mocked. The helpers tests call themselves are in tests/services.py.
"""

import os
from pathlib import Path

import pytest

from tests.services import (
    PG_ADMIN_URL,
    REDIS_TEST_URL,
    SpecqWorker,
    create_database,
    drop_database,
    empty_database,
    flushed_redis,
)


@pytest.fixture(scope="session")
def demo_pair():
    """models.demo.DemoModels: target_dir, draft_dir and the build's report."""
    from specq.models.demo import build_demo_models

    return build_demo_models()


@pytest.fixture(scope="module")
def target():
    """The tiny random Llama the engine tests decode with (tests/tiny_models.py); a module may define its own."""
    from tests.tiny_models import tiny_llama

    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft(target):
    """A noisy copy of `target`: partial agreement, so per-row rollbacks happen every few tokens."""
    from tests.tiny_models import noisy_copy

    return noisy_copy(target, scale=0.002)


@pytest.fixture(autouse=True)
def _specq_isolated_env(tmp_path_factory, monkeypatch):
    """No test sees the user's data directory or service URLs."""
    monkeypatch.setenv("SPECQ_HOME", str(tmp_path_factory.mktemp("specq_home")))
    for name in ("SPECQ_DATABASE_URL", "SPECQ_BROKER_URL", "SPECQ_TARGET", "SPECQ_DRAFT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def pg_url():
    """A PostgreSQL database for this test session; skipped when no server answers."""
    import psycopg

    name = f"specq_test_{os.getpid()}"
    try:
        url = create_database(name)
    except psycopg.OperationalError as exc:
        pytest.skip(f"no PostgreSQL at {PG_ADMIN_URL}: {exc}")
    yield url
    drop_database(name)


@pytest.fixture
def pg_db_url(pg_url):
    """The session's PostgreSQL database, migrated and emptied for this test."""
    empty_database(pg_url)
    return pg_url


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'specq.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db_url(request, tmp_path):
    """Each test using it runs on both stores."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'specq.db'}"
    return request.getfixturevalue("pg_db_url")


@pytest.fixture
def redis_url():
    """Redis database 15, flushed before and after the test; skipped when no server answers."""
    client = flushed_redis(REDIS_TEST_URL)
    yield REDIS_TEST_URL
    client.flushdb()
    client.close()


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir): tests.tiny_models.save_tiny_pair, built once per session."""
    from tests.tiny_models import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("tiny_pair"))


@pytest.fixture
def decoy_folder(tmp_path) -> Path:
    """A user's project folder whose generic module names would shadow specq's if it ever imported them."""
    folder = tmp_path / "project"
    for package in ("cli", "db", "jobs", "worker"):
        (folder / package).mkdir(parents=True)
        (folder / package / "__init__.py").write_text(f"raise ImportError('decoy {package} imported')\n")
    for module in ("models", "decoding"):
        (folder / f"{module}.py").write_text(f"raise ImportError('decoy {module} imported')\n")
    return folder


@pytest.fixture
def start_worker(tmp_path):
    """Factory: start_worker(env) -> a ready SpecqWorker; all are stopped (SIGTERM) after the test."""
    started: list[SpecqWorker] = []

    def start(env, **kwargs):
        worker = SpecqWorker(env, tmp_path / f"worker{len(started)}.log", **kwargs)
        started.append(worker)
        return worker.wait_ready()

    yield start
    for worker in started:
        worker.stop()
