"""An operable fleet, with real `specq worker` processes on the real services:

1. a worker bound to a device this host lacks exits 3 with one line, before it registers or consumes;
2. a worker whose job's model weights are gone gives the chunk back (nothing failed, nothing stored)
   and exits 4; a good worker then runs the job: every request completed, exactly once;
3. Celery's own tool answers: `celery -A specq.worker.app inspect ping` (the broker from the
   environment, no `-b`) gets the good worker's pong;
4. its metrics page, scraped after the job, passes `promtool check metrics`, and its counters equal the
   job's stored results; model_name is the folder's name, never its path.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from sqlalchemy import func, select

from specq.db.models import Request, Result, Worker
from specq.db.session import open_database
from tests.fleet_helpers import DRILL_ENV, wait_for
from tests.services import SpecqWorker, job_status, request_states, services_env, submit_job, write_requests

METRICS_PORT = 19741


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (.ci/run installs Debian's prometheus package)")
    return path


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def sample(text: str, name: str) -> float:
    """The sum of a metric's samples over its label sets."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def listening_addresses(port: int) -> set[str]:
    """The IPv4 addresses that sockets listening on `port` are bound to, read from /proc/net/tcp."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


def test_misconfigured_workers_fail_nothing_and_the_good_one_is_seen(pg_db_url, redis_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, redis_url, tmp_path / "home", **DRILL_ENV)
    db = open_database(pg_db_url)

    # 1. a device the host lacks: exit 3, one line, never registered
    bad_device = SpecqWorker(env, tmp_path / "cuda3.log", device="cuda:3")
    assert bad_device.proc.wait(120) == 3, bad_device.output()
    bad_device.stop()
    assert bad_device.output().strip().splitlines()[-1].startswith("Error: device cuda:3 is unusable")
    assert "Traceback" not in bad_device.output()
    with db.session() as session:
        assert session.scalar(select(func.count()).select_from(Worker)) == 0

    # 2. the job's target weights vanish from this host: the worker gives the chunk back and exits 4
    target = tmp_path / "target-model"
    shutil.copytree(tiny_pair[0], target)
    lines = [{"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 8, "temperature": 0} for i in range(12)]
    job_id = submit_job(
        env, write_requests(tmp_path / "in.jsonl", lines), "--target", str(target), "--draft", tiny_pair[1]
    )
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    weights = [p for p in target.iterdir() if p.suffix == ".safetensors"]
    assert weights
    for path in weights:
        path.rename(hidden / path.name)
    no_weights = SpecqWorker(env, tmp_path / "noweights.log")
    assert no_weights.proc.wait(120) == 4, no_weights.output()
    no_weights.stop()
    assert no_weights.output().strip().splitlines()[-1].startswith(f"Error: cannot load the models of job {job_id}")
    assert "Traceback" not in no_weights.output()
    with db.session() as session:
        assert request_states(session, job_id) == {"queued": 12}
        assert session.scalar(select(func.count()).select_from(Result)) == 0

    # the weights are back; a good worker takes the chunk that was given back
    for path in weights:
        (hidden / path.name).rename(target / path.name)
    good = SpecqWorker(env, tmp_path / "good.log", metrics_port=METRICS_PORT).wait_ready()
    try:
        wait_for(lambda: job_status(env, job_id)["state"] == "completed", 120, "the job to complete")
        info = job_status(env, job_id)
        assert (info["completed"], info["failed"]) == (12, 0)

        # 3. celery inspect, with the broker from SPECQ_BROKER_URL only (the destination: answer at once)
        with db.session() as session:
            name = session.scalars(select(Worker.name).where(Worker.state != "stopped")).one()
        ping = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "specq.worker.app", "inspect", "ping", "-t", "10", "-d", name],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ping.returncode == 0 and "pong" in ping.stdout, ping.stdout + ping.stderr

        # 4. the metrics page: promtool accepts it, its counters are the job's stored results
        text = scrape(METRICS_PORT)
        assert listening_addresses(METRICS_PORT) == {"127.0.0.1"}  # --metrics-host's default: loopback only
    finally:
        assert good.stop() == 0, good.output()
    checked = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with db.session() as session:
        stored = session.execute(
            select(
                func.count(),
                func.sum(Result.completion_tokens),
                func.sum(Result.draft_tokens),
                func.sum(Result.accepted_tokens),
            )
            .join(Request)
            .where(Request.job_id == job_id)
        ).one()
    count, completion_tokens, draft_tokens, accepted_tokens = stored
    assert sample(text, "specq_request_success_total") == count == 12
    assert sample(text, "specq_request_failure_total") == 0
    assert sample(text, "specq_generation_tokens_total") == completion_tokens
    assert sample(text, "specq_spec_decode_num_draft_tokens_total") == draft_tokens
    assert sample(text, "specq_spec_decode_num_accepted_tokens_total") == accepted_tokens
    assert sample(text, "specq_e2e_request_latency_seconds_count") == 12
    assert sample(text, "specq_time_to_first_token_seconds_count") == 12
    assert sample(text, "specq_request_queue_time_seconds_count") == 12
    assert 'finished_reason="length"' in text
    assert 'model_name="target-model"' in text and str(tmp_path) not in text
    assert "process_cpu_seconds_total" in text and "specq_live_workers" in text
    assert 'specq_backlog_requests{job_state="queued"}' in text
