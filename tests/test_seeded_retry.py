"""Seeded retries after a kill -9 are byte-identical (issue 9, item 6's last sentence).

With the default `--sampling reproducible`, a seeded request's tokens are those target-only decoding
samples with its seed, whatever the batch, the k schedule or the worker. So a job of seeded *sampled*
requests (temperature 0.7 to 1.0, top-p and top-k), run once undisturbed and once with the worker
holding a chunk killed with SIGKILL mid-chunk (the other worker takes the chunk up once its lease has
expired), exports the same completions and tokens, byte for byte. Only the draft counters, which depend
on how the requests were batched, may differ.
"""

from __future__ import annotations

import json
import signal

from sqlalchemy import func, select

from specq.db.models import Request
from specq.db.session import open_database
from tests.fleet_helpers import DRILL_ENV, freeze_a_worker_mid_chunk, wait_for
from tests.services import invoke, services_env, submit_job, wait_state, write_requests

LINES = [
    {
        "id": f"s{i}",
        "prompt": f"def f{i}(x):",
        "max_tokens": 40,  # long enough chunks that a loaded machine is still caught mid-chunk
        "temperature": (0.7, 0.85, 1.0)[i % 3],
        "top_p": (1.0, 0.9, 0.95)[i % 3],
        "top_k": (0, 20, 8)[i % 3],
        "seed": 1000 + i,
    }
    for i in range(32)
]
DRAFT_COUNTERS = ("draft_tokens", "accepted_tokens")


def exported(env: dict[str, str], job_id: str, path) -> list[bytes]:
    """The job's jsonl export, one line a request, without the draft counters, as bytes."""
    result = invoke(["export", job_id, "-o", str(path)], env)
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [json.dumps({k: v for k, v in r.items() if k not in DRAFT_COUNTERS}).encode() for r in records]


def test_seeded_sampled_job_is_byte_identical_after_a_kill_9(pg_db_url, redis_url, tiny_pair, start_worker, tmp_path):
    env = services_env(pg_db_url, redis_url, tmp_path / "home", **DRILL_ENV)
    workers = [start_worker(env), start_worker(env)]
    path = write_requests(tmp_path / "in.jsonl", LINES)
    args = ("--target", tiny_pair[0], "--draft", tiny_pair[1], "--batch-size", "2")  # chunks of 8

    undisturbed = submit_job(env, path, *args)
    assert wait_state(env, undisturbed, {"completed", "failed", "cancelled"}, 120)["state"] == "completed"

    killed = submit_job(env, path, *args)
    db = open_database(env["SPECQ_DATABASE_URL"])
    victim = wait_for(
        lambda: freeze_a_worker_mid_chunk(db, killed, workers, len(LINES)), 60, "a worker mid-chunk", poll=0.02
    )
    victim.stop(signal.SIGKILL)
    info = wait_state(env, killed, {"completed", "failed", "cancelled"}, 120)
    assert (info["state"], info["completed"]) == ("completed", len(LINES)), info
    with db.session() as session:  # the killed worker's chunk was run again by the other
        assert session.scalar(select(func.max(Request.attempts)).where(Request.job_id == killed)) == 2

    first, second = exported(env, undisturbed, tmp_path / "a.jsonl"), exported(env, killed, tmp_path / "b.jsonl")
    assert len(first) == len(LINES) and first == second
    samples = [json.loads(line)["tokens"] for line in first]
    assert len({tuple(tokens) for tokens in samples}) > len(LINES) // 2  # sampled, not one greedy answer
