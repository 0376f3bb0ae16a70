"""The suite passes over Redis databases that hold somebody else's keys, instead of erroring on them.

On a shared machine another user's queue sat in the database the suite would take (db 13, xdist's gw2)
and 13 tests errored. tests/services.py now chooses each xdist worker's database among the free ones
(empty, or holding the suite's ownership mark), in one order every worker reads alike, and starts a
redis-server of its own where none is left. These tests write their foreign keys only into a database
the suite owns for the test (the machine's server) or into servers of their own, and delete exactly them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.private_servers import PrivateRedis
from tests.services import (
    REDIS_DATABASES,
    REDIS_OWNER_KEY,
    REDIS_TEST_URL,
    choose_redis_test_url,
    flush_redis,
    flushed_redis,
)

ROOT = Path(__file__).resolve().parent.parent
FOREIGN_KEY = "someone-else:queue"  # another user's data, as the suite sees it: a key without the mark


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    """A redis-server of this module's alone: every database's contents are the test's to set."""
    try:
        server = PrivateRedis(tmp_path_factory.mktemp("own_redis"))
    except FileNotFoundError as exc:
        pytest.skip(f"no redis-server: {exc}")
    server.start()
    yield server
    server.stop()


def _occupy(url: str) -> None:
    redis.Redis.from_url(url).rpush(FOREIGN_KEY, "a task of somebody else's")


def _db(url: str) -> int:
    return int(url.rsplit("/", 1)[1])


def _chosen_at_import(url: str, worker: str) -> str:
    """REDIS_TEST_URL as a fresh test process (xdist worker `worker`) chooses it for SPECQ_TEST_REDIS_URL=url."""
    env = {**os.environ, "SPECQ_TEST_REDIS_URL": url, "PYTEST_XDIST_WORKER": worker}
    done = subprocess.run(
        [sys.executable, "-c", "from tests.services import REDIS_TEST_URL; print(REDIS_TEST_URL)"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_choice_skips_a_database_holding_foreign_keys() -> None:
    # the database this process uses, owned for the test, made to look like somebody else's
    client = flushed_redis(REDIS_TEST_URL)
    try:
        client.delete(REDIS_OWNER_KEY)
        _occupy(REDIS_TEST_URL)
        chosen = choose_redis_test_url(REDIS_TEST_URL, worker=0)
        assert chosen is not None and chosen != REDIS_TEST_URL
        assert _chosen_at_import(REDIS_TEST_URL, "gw0") not in (REDIS_TEST_URL, "")
        assert client.lrange(FOREIGN_KEY, 0, -1) == [b"a task of somebody else's"]  # passed over, not flushed
    finally:
        client.delete(FOREIGN_KEY)  # only the key this test wrote
        client.close()
        flush_redis(REDIS_TEST_URL).close()


def test_each_worker_takes_another_free_database_in_one_order(own_redis) -> None:
    base = own_redis.url(15)
    assert [_db(choose_redis_test_url(base, worker) or "/-1") for worker in range(3)] == [15, 14, 13]
    _occupy(own_redis.url(15))
    _occupy(own_redis.url(13))
    marked = redis.Redis.from_url(own_redis.url(14))
    marked.set(REDIS_OWNER_KEY, "1")
    marked.set("left-by-an-earlier-test", "1")  # the suite's own database, with keys in it, is free
    try:
        assert [_db(choose_redis_test_url(base, worker) or "/-1") for worker in range(4)] == [14, 12, 11, 10]
        assert _chosen_at_import(base, "gw1") == own_redis.url(12)  # what the test process and its workers get
        # the order wraps round below 0 (1, 0, then 15: somebody else's, 14)
        assert _db(choose_redis_test_url(own_redis.url(1), 2) or "/-1") == 14
    finally:
        redis.Redis.from_url(own_redis.url(15)).delete(FOREIGN_KEY)
        redis.Redis.from_url(own_redis.url(13)).delete(FOREIGN_KEY)
        marked.delete(REDIS_OWNER_KEY, "left-by-an-earlier-test")


def test_with_no_free_database_left_a_private_server_is_started(own_redis) -> None:
    for db in range(REDIS_DATABASES):
        _occupy(own_redis.url(db))
    try:
        assert choose_redis_test_url(own_redis.url(15), 0) is None
        chosen = _chosen_at_import(own_redis.url(15), "gw0")
        assert chosen.startswith("redis://127.0.0.1:") and not chosen.startswith(own_redis.url(0)[:-1])
        port = int(chosen.split(":")[2].split("/")[0])
        # the process that started it stopped it on its way out
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=port, socket_connect_timeout=1).ping()
    finally:
        for db in range(REDIS_DATABASES):
            redis.Redis.from_url(own_redis.url(db)).delete(FOREIGN_KEY)
