"""Shared test fixtures.

Nothing here trains a model: tests that decode use `tiny_pair` (random weights, built in seconds) or the
real catalogue models. The trained toy pair of models/demo/ (`demo_pair`) is built only where
SPECQ_TEST_TOY_PAIR=1 asks for it (minutes of CPU, 41 on a loaded machine); its few tests say why they
need it. Session-scoped fixtures are set up before the function-scoped `_specq_isolated_env`, so that
build lands in the user's data dir (or $SPECQ_HOME), not a test tmp dir.

Storage and queue fixtures use the real services: a throwaway PostgreSQL database per test session
(specq_test_<pid>, dropped at the end), Redis database 15 flushed around each test, real `specq worker`
subprocesses. Nothing is mocked. The helpers tests call themselves are in tests/services.py. The drills that
stop or restart a server get servers of their own (`private_redis`, `private_postgres`): the suite never
stops, flushes or drops anything of the machine's servers that it did not create.
"""

import os
from pathlib import Path

import pytest

from tests.private_servers import PrivatePostgres, PrivateRedis
from tests.services import (
    PG_ADMIN_URL,
    REDIS_TEST_URL,
    SpecqWorker,
    create_database,
    drop_database,
    empty_database,
    flush_redis,
    flushed_redis,
)


@pytest.fixture(scope="session")
def demo_pair():
    """models.demo.DemoModels: target_dir, draft_dir and the build's report; skipped unless
    SPECQ_TEST_TOY_PAIR=1, since building it costs minutes before the first test."""
    if os.environ.get("SPECQ_TEST_TOY_PAIR") != "1":
        pytest.skip("the trained toy pair is opt-in: SPECQ_TEST_TOY_PAIR=1 builds it (minutes of CPU)")
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
    """Redis database 15 (SPECQ_TEST_REDIS_URL; another where it holds somebody else's keys: tests/services.py
    `_redis_test_url`), emptied before and after the test (tests/services.py
    flush_redis: never a database holding keys the suite did not write); skipped when no server answers."""
    flushed_redis(REDIS_TEST_URL).close()
    yield REDIS_TEST_URL
    flush_redis(REDIS_TEST_URL).close()


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


@pytest.fixture(scope="session")
def private_redis(tmp_path_factory):
    """A Redis server of the session's own (tests/private_servers.py), for drills that restart it."""
    try:
        server = PrivateRedis(tmp_path_factory.mktemp("private_redis"))
    except FileNotFoundError as exc:
        pytest.skip(f"no private Redis: {exc}")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def private_postgres():
    """A PostgreSQL cluster of the session's own (tests/private_servers.py), for drills that stop it."""
    try:
        server = PrivatePostgres()
    except FileNotFoundError as exc:
        pytest.skip(f"no private PostgreSQL: {exc}")
    try:
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture
def private_db_url(private_postgres):
    """A new database on the private PostgreSQL for this test, dropped after it."""
    url = create_database("specq_drill", private_postgres.admin_url)
    yield url
    if private_postgres.up():
        drop_database("specq_drill", private_postgres.admin_url)


# -- the longest files first: pytest-xdist hands out files in collection order, and one of these taken last
# would leave one process working alone for minutes at the end
_LONGEST_FIRST = ("test_pair.py", "test_compiled.py", "test_real_models.py", "test_hostile_round2.py", "test_fleet.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return _LONGEST_FIRST.index(name) if name in _LONGEST_FIRST else len(_LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a file, and among the rest, the order stays


# -- a progress line with an ETA every half minute (tests/suite_progress.py) ------------------------------
_progress: dict = {}  # reporter: pytest's terminal reporter; suite: the SuiteProgress, once the total is known


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        # xdist workers on two cores: a thread each. Two OpenMP pools of two threads spun against each other
        # and ran the torch-heavy tests several times slower than one pool did.
        import torch

        torch.set_num_threads(1)


def pytest_collection_finish(session):
    if not hasattr(session.config, "workerinput"):  # an xdist worker's lines would reach no one
        _start_progress(session.config, len(session.items))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Under pytest-xdist the controller collects nothing itself: each worker reports the same ids."""
    if "suite" not in _progress or not _progress["suite"].total:
        _start_progress(node.config, len(ids))


def _start_progress(config, total):
    from tests.suite_progress import SuiteProgress

    _progress.update(reporter=config.pluginmanager.get_plugin("terminalreporter"), suite=SuiteProgress(total))


def pytest_runtest_logfinish(nodeid, location):
    if not _progress.get("reporter") or not _progress["suite"].total:
        return
    line = _progress["suite"].finished()
    if line is not None:
        _progress["reporter"].write("\n")  # -q leaves the line of dots open
        _progress["reporter"].write_line(line)
