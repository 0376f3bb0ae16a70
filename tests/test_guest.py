"""The suite is a guest on the machine: it empties only Redis databases it owns, restarts only servers it
started, and no verdict of the adaptive-k policy's tests rests on the machine's speed (.ci/run checks the
first two from the outside too: a sentinel key, a sentinel database and both servers' process ids)."""

from __future__ import annotations

import pytest
import redis

from specq.decoding.k_policy import SpeculationPolicy
from tests.policy_timing import modelled_step_times
from tests.services import REDIS_OWNER_KEY, ForeignRedisData, flush_redis


def test_a_redis_database_holding_someone_elses_keys_is_never_flushed(private_redis):
    theirs = redis.Redis.from_url(private_redis.url(3))
    theirs.flushdb()
    theirs.set("their:key", "precious")
    with pytest.raises(ForeignRedisData, match="did not write"):
        flush_redis(private_redis.url(3))
    assert theirs.get("their:key") == b"precious"
    # an empty database becomes the suite's, and the suite may empty it again
    theirs.flushdb()
    ours = flush_redis(private_redis.url(3))
    ours.set("specq:something", "1")
    flush_redis(private_redis.url(3)).close()
    assert ours.keys() == [REDIS_OWNER_KEY.encode()]
    ours.close()
    theirs.close()


def test_a_private_server_restarts_alone(private_redis, private_postgres):
    machine = redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=1)
    try:
        machine_pid = machine.info("server")["process_id"]
    except redis.RedisError:
        machine_pid = None
    redis_pid, postgres_pid = private_redis.pid(), private_postgres.pid()
    private_redis.restart(down_s=0.0)
    private_postgres.restart(down_s=0.0)
    assert private_redis.pid() != redis_pid and private_postgres.pid() != postgres_pid
    assert private_redis.up() and private_postgres.up()
    if machine_pid is not None:
        assert machine.info("server")["process_id"] == machine_pid
    machine.close()


def test_modelled_step_times_replace_what_the_machine_measured(monkeypatch):
    policy = SpeculationPolicy(4, fixed=False)
    modelled_step_times(monkeypatch, policy, lambda rows, width: 0.010 * width, t_draft_forward=0.001)
    # a machine so busy that a step took 5 s: the policy learns the model's times all the same
    policy.observe_step(2, 3, 5.0, 5.0, 15.0, t_offer=1.0, draft_forwards=3)
    assert policy.t_target[2][4].value == pytest.approx(0.040)
    assert policy.t_draft[2][3].value == pytest.approx(0.003)
    assert policy.t_offer[2].value == 0.0
    assert policy.t_overhead[True][2].value == pytest.approx(0.0, abs=1e-12)
