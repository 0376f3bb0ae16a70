"""The queue under load, and its failure drills: what `docs/benchmarks.md` ("Queue load run") and
`docs/reliability.md` report, reproducible with one command each.

    python benchmarks/load_run.py load   [--requests 20000] [--workers 2]   # throughput, queue overhead
    python benchmarks/load_run.py drills [--requests 3000] [--fast]         # kill -9, Redis and PostgreSQL restarts
    python benchmarks/load_run.py submit [--requests 1000000]              # submit lines/s and peak memory
    python benchmarks/load_run.py warm   [--requests 256]                  # a warmed worker against `specq run`

Each run gets a throwaway PostgreSQL database (created on `--pg-admin-url`, dropped at the end) and
Redis database `--redis-url` (flushed before and after), real `specq worker` processes on the CPU, and
greedy requests of 2 to 4 tokens on the tiny model pair of the tests (tests/tiny_models.py `save_tiny_pair`,
built here in seconds) or `--models demo` (the trained toy pair, models/demo/: minutes to build). It prints a Markdown
section on stdout; progress goes to stderr. The services, workers and waits are the tests' own helpers
(tests/services.py, tests/fleet_helpers.py); what is timed (`specq submit`, `specq run`) runs as a user
runs it, in its own process.

Figures:

- throughput: requests (and completion tokens) per second from the job's first claim to its end;
- queue overhead: the share of the workers' time not spent inside the engine, 1 - (engine seconds
  summed over the job's batches) / (workers x job seconds): claims, tokenizing, result writes, task
  dispatch, idle waits; and the same requests through `specq run` (one process, no queue) for scale;
- lost / duplicated: requests with no result / results beyond one per request (the unique index makes
  the second impossible; it is counted anyway), and the job's counters checked against the rows.

The drills restart Redis and PostgreSQL servers of their own (tests/private_servers.py: `redis-server` and
`initdb`/`pg_ctl` on free ports, in a temporary folder), never the machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the tests' helpers, imported from the repository this script is in
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fleet_helpers import DRILL_ENV, wait_for
from tests.private_servers import PrivatePostgres, PrivateRedis
from tests.services import (
    PG_ADMIN_URL,
    SpecqWorker,
    create_database,
    database_url,
    drop_database,
    flush_redis,
    job_status,
    request_states,
    services_env,
    wait_state,
)

SPECQ = (sys.executable, "-P", "-m", "specq")
TERMINAL = ("completed", "failed", "cancelled")


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- models --------------------------------------------------------------------------------------------
def model_pair(kind: str, root: Path) -> tuple[str, str]:
    if kind == "demo":
        from specq.models.demo import build_demo_models

        demo = build_demo_models()
        return str(demo.target_dir), str(demo.draft_dir)
    from tests.tiny_models import save_tiny_pair

    return save_tiny_pair(root)


# -- services ------------------------------------------------------------------------------------------
@dataclass
class Services:
    """This run's PostgreSQL database (on the server of `admin_url`) and Redis database."""

    admin_url: str
    redis_url: str
    db_name: str = field(default_factory=lambda: f"specq_bench_{os.getpid()}")

    @property
    def db_url(self) -> str:
        return database_url(self.db_name, self.admin_url)

    def create(self) -> None:
        """A new, empty database, and the Redis database flushed."""
        create_database(self.db_name, self.admin_url)
        flush_redis(self.redis_url).close()

    def drop(self) -> None:
        drop_database(self.db_name, self.admin_url)
        flush_redis(self.redis_url).close()

    def env(self, home: Path, **extra: str) -> dict[str, str]:
        return services_env(self.db_url, self.redis_url, home, **extra)


def seconds_until(check: Callable[[], Any], timeout: float, what: str, poll: float = 0.05) -> float:
    """Poll until `check()` is true (fleet_helpers.wait_for); the seconds it took."""
    began = time.monotonic()
    wait_for(check, timeout, what, poll)
    return time.monotonic() - began


# -- workers and jobs ----------------------------------------------------------------------------------
@contextmanager
def workers(env: dict[str, str], count: int, logs: Path) -> Iterator[list[SpecqWorker]]:
    """`count` ready `specq worker --device cpu` processes; stopped (SIGTERM) at the end."""
    started: list[SpecqWorker] = []
    try:
        for _ in range(count):
            started.append(SpecqWorker(env, logs / f"worker{len(started)}.log"))
        for worker in started:  # they start side by side; each wait is the rest of the slowest start
            worker.wait_ready(timeout=180)
        yield started
    finally:
        for worker in started:
            worker.stop(timeout=120)


def write_input(path: Path, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = ["def", "class", "return", "import", "for", "while", "print", "self", "value", "items", "data"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) + f" {i}:"
            f.write(json.dumps({"id": f"q{i}", "prompt": prompt, "max_tokens": rng.randint(2, 4), "temperature": 0}))
            f.write("\n")


def submit(env: dict[str, str], path: Path, target: str, draft: str, batch_size: int) -> tuple[str, float]:
    """`specq submit` in its own process, as a user runs it: the job id and the wall seconds."""
    began = time.monotonic()
    done = subprocess.run(
        [*SPECQ, "submit", str(path), "--target", target, "--draft", draft, "--batch-size", str(batch_size)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip(), time.monotonic() - began


def timed_run(env: dict[str, str], path: Path, out: Path, target: str, draft: str, batch_size: int) -> float:
    """Wall seconds of `specq run` on the same file: one process, no queue, no database."""
    models = ["--target", target, "--draft", draft, "--batch-size", str(batch_size)]
    began = time.monotonic()
    subprocess.run(
        [*SPECQ, "run", str(path), "-o", str(out), *models],
        env={**env, "SPECQ_DATABASE_URL": "", "SPECQ_BROKER_URL": ""},
        check=True,
        capture_output=True,
    )
    return time.monotonic() - began


def counts(db_url: str, job_id: str) -> dict[str, Any]:
    """The job's row, its requests by state, and its results: what was lost or duplicated."""
    from sqlalchemy import func, select

    from specq.db.models import Batch, Job, Request, Result
    from specq.db.session import open_database

    with open_database(db_url).session() as session:
        job = session.get_one(Job, job_id)
        states = request_states(session, job_id)
        results, distinct = session.execute(
            select(func.count(Result.id), func.count(func.distinct(Result.request_id)))
            .join(Request)
            .where(Request.job_id == job_id)
        ).one()
        claimed_again = session.scalar(select(func.count()).where(Request.job_id == job_id, Request.attempts > 1))
        engine_s, batches = session.execute(
            select(func.coalesce(func.sum(Batch.seconds), 0.0), func.count(Batch.id)).where(Batch.job_id == job_id)
        ).one()
        wall = (job.finished_at - job.started_at).total_seconds() if job.finished_at and job.started_at else None
        return {
            "state": job.state,
            "total": job.total,
            "completed": job.completed,
            "failed": job.failed,
            "tokens": job.generated_tokens,
            "chunk_size": job.settings["chunk_size"],
            "states": states,
            "results": results,
            "lost": job.total - distinct,
            "duplicated": results - distinct,
            "counters_agree": job.completed + job.failed == results,
            "claimed_again": claimed_again,
            "engine_s": float(engine_s),
            "batches": batches,
            "wall_s": wall,
        }


def progress(env: dict[str, str], job_id: str) -> tuple[str, int]:
    """The job's state and how many of its requests have ended (`specq status --json`)."""
    info = job_status(env, job_id)
    return info["state"], info["completed"] + info["failed"]


def wait_done(env: dict[str, str], job_id: str, timeout: float) -> float:
    """Wait for the job's end (services.wait_state); the seconds it took."""
    began = time.monotonic()
    wait_state(env, job_id, TERMINAL, timeout)
    return time.monotonic() - began


# -- the load run --------------------------------------------------------------------------------------
def load(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="specq_load_"))
    services = Services(args.pg_admin_url, args.redis_url)
    target, draft = model_pair(args.models, work)
    path = work / "in.jsonl"
    write_input(path, args.requests)
    services.create()
    try:
        env = services.env(work / "home")
        say(f"starting {args.workers} workers")
        with workers(env, args.workers, work):
            say(f"submitting {args.requests} requests")
            job_id, submit_s = submit(env, path, target, draft, args.batch_size)
            wait_done(env, job_id, args.timeout)
            found = counts(services.db_url, job_id)
        say("the same file through `specq run` (one process, no queue)")
        run_s = timed_run(env, path, work / "run.jsonl", target, draft, args.batch_size)
    finally:
        services.drop()
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    wall = found["wall_s"] or float("nan")
    busy = found["engine_s"] / (args.workers * wall)
    load_avg = os.getloadavg()
    print(
        f"""
## Queue load run

`python benchmarks/load_run.py load --requests {args.requests} --workers {args.workers} --models {args.models}`
({time.strftime("%Y-%m-%d")}; {os.cpu_count()} CPU cores, load average {load_avg[0]:.1f} at the end;
PostgreSQL and Redis on the same machine; {args.workers} `specq worker --device cpu` processes, one
thread each; greedy requests of 2 to 4 tokens, batch size {args.batch_size}, chunks of
{found["chunk_size"]} requests.)

| | |
| --- | --- |
| requests | {found["total"]} ({found["completed"]} completed, {found["failed"]} failed) |
| lost / duplicated | {found["lost"]} / {found["duplicated"]}; job counters match the rows: {found["counters_agree"]} |
| submit (validate, store, enqueue) | {submit_s:.1f} s, model check included |
| first claim to last result | {wall:.1f} s |
| throughput | {found["total"] / wall:,.0f} requests/s, {found["tokens"] / wall:,.0f} tokens/s |
| engine time, summed over {found["batches"]} batches | {found["engine_s"]:.1f} s |
| queue overhead (workers' time outside the engine) | {100 * (1 - busy):.0f} % |
| `specq run`, same file, no queue | {run_s:.1f} s, model load included ({found["total"] / run_s:,.0f} req/s) |
"""
    )


# -- submit throughput ---------------------------------------------------------------------------------
def timed_submit(env: dict[str, str], path: Path, target: str, draft: str) -> tuple[float, int, int]:
    """Wall seconds of one `specq submit` process, and the peak resident memory (KiB) of that process and
    of its model-check child."""
    # VmHWM, not getrusage's ru_maxrss: after fork and exec that still counts the parent's (this script's,
    # models loaded) memory at the fork
    probe = (
        "import re, resource, sys\n"
        "from specq.cli.main import main\n"
        "try:\n    main()\nfinally:\n"
        "    own = re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
        "    print(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    )
    args = ["submit", str(path), "--target", target, "--draft", draft]
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", probe, *args], env=env, capture_output=True, text=True, check=True)
    seconds = time.monotonic() - began
    own, child = done.stderr.split()[-2:]
    return seconds, int(own), int(child)


def submit_rate(args: argparse.Namespace) -> None:
    """`specq submit` into PostgreSQL + Redis with no worker running: lines/s and peak memory at two sizes."""
    from specq.jobs.model_check import PASSED_FILE

    work = Path(tempfile.mkdtemp(prefix="specq_submit_"))
    services = Services(args.pg_admin_url, args.redis_url)
    target, draft = model_pair(args.models, work)
    # (lines, model check remembered?): the first run warms the file cache (imports) and is not shown;
    # then the start-up cost with and without the check, the two sizes, and the larger one checked again
    sizes = [(1, False), (1, False), (1, True), (max(args.requests // 5, 2), True), (args.requests, True)]
    sizes.append((args.requests, False))
    home = work / "home"
    rows = []
    try:
        for size, remembered in sizes:
            path = work / f"in{size}.jsonl"
            write_input(path, size)
            services.create()
            if not remembered:
                (home / PASSED_FILE).unlink(missing_ok=True)
            seconds, peak_kib, child_kib = timed_submit(services.env(home), path, target, draft)
            rows.append((size, remembered, seconds, peak_kib, child_kib))
            say(f"{size} lines: {seconds:.2f} s, peak {peak_kib // 1024} MiB, model check {child_kib // 1024} MiB")
            path.unlink()
    finally:
        services.drop()
        shutil.rmtree(work, ignore_errors=True)
    lines = [
        f"| {size:,} | {'remembered' if remembered else f'in a child, {child / 1024:.0f} MiB'} | {seconds:.2f} s | "
        f"{f'{size / seconds:,.0f}' if size > 1 else ''} | {peak / 1024:.0f} MiB |"
        for size, remembered, seconds, peak, child in rows[1:]
    ]
    print(
        f"""
## Submit throughput

`python benchmarks/load_run.py submit --requests {args.requests}` ({time.strftime("%Y-%m-%d %H:%M")}; {os.cpu_count()}
CPU cores, load average {os.getloadavg()[0]:.1f} at the end; PostgreSQL and Redis on the same machine; no
worker running). One `specq submit` process per file: validate every line, store (COPY), enqueue the
chunks, on a fresh database each time. The model check (both tokenizers and configs) runs in a child
process beside the read, unless the same model folders passed it before ("remembered"). The one-line
file shows the fixed cost (interpreter, imports, the schema migration, and the check where it runs).

| lines | model check | wall | lines/s | peak memory |
| ---: | --- | ---: | ---: | ---: |
"""
        + "\n".join(lines)
    )


# -- a warmed worker against `specq run` ---------------------------------------------------------------
def warm(args: argparse.Namespace) -> None:
    """One job through one warmed `specq worker` (models loaded, one small job done) against `specq run` on
    the same file, same models, batch size and threads: the queue path's whole cost for a user."""
    from specq.models.demo import heldout_prompts

    work = Path(tempfile.mkdtemp(prefix="specq_warm_"))
    services = Services(args.pg_admin_url, args.redis_url)
    target, draft = model_pair(args.models, work)
    prompts = heldout_prompts(args.requests)
    path = work / "in.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, prompt in enumerate(prompts):
            f.write(json.dumps({"id": f"q{i}", "prompt": prompt, "max_tokens": 64, "temperature": 0}) + "\n")
    warmup = work / "warmup.jsonl"
    warmup.write_text("".join(path.read_text().splitlines(keepends=True)[: args.batch_size]))
    threads = str(args.threads)
    services.create()
    try:
        env = services.env(work / "home", OMP_NUM_THREADS=threads)
        with workers(env, 1, work):
            job_id, _ = submit(env, warmup, target, draft, args.batch_size)
            wait_done(env, job_id, args.timeout)
            say(f"worker warm; submitting {args.requests} requests")
            began = time.monotonic()
            job_id, submit_s = submit(env, path, target, draft, args.batch_size)
            wait_done(env, job_id, args.timeout)
            queue_s = time.monotonic() - began
            found = counts(services.db_url, job_id)
        say("the same file through `specq run`")
        run_s = timed_run(env, path, work / "run.jsonl", target, draft, args.batch_size)
    finally:
        services.drop()
        shutil.rmtree(work, ignore_errors=True)
    outcome = (
        f"submit {submit_s:.1f} s; {found['completed']} completed, {found['failed']} failed, "
        f"lost {found['lost']}, duplicated {found['duplicated']}"
    )
    print(
        f"""
## A warmed worker against `specq run`

`python benchmarks/load_run.py warm --requests {args.requests} --models {args.models}`
({time.strftime("%Y-%m-%d %H:%M")}; {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end;
{args.requests} greedy held-out code prompts, max_tokens 64, batch size {args.batch_size}, {threads} torch threads
in both). The worker had loaded the models and finished an {args.batch_size}-request job before; the queue time
runs from the start of `specq submit` to the job's end as PostgreSQL records it; `specq run` includes loading the
models.

| | seconds | |
| --- | ---: | --- |
| `specq submit` + one warmed worker | {queue_s:.1f} | {outcome} |
| `specq run` | {run_s:.1f} | |
| queue / run | {queue_s / run_s:.2f}x | target: at most 1.25x |
"""
    )


# -- the drills ----------------------------------------------------------------------------------------
@dataclass
class Drill:
    name: str
    fault_at: int  # requests done when the fault hit
    recovered_s: float  # fault (or service back) -> the lost work moving again
    detail: str
    job_s: float
    found: dict[str, Any]


def owner_count(db_url: str, job_id: str, owner_pid: int) -> int:
    from sqlalchemy import func, select

    from specq.db.models import Request
    from specq.db.session import open_database

    with open_database(db_url).session() as session:
        return (
            session.scalar(
                select(func.count()).where(
                    Request.job_id == job_id, Request.state == "running", Request.lease_owner.like(f"%:{owner_pid}")
                )
            )
            or 0
        )


def drills(args: argparse.Namespace) -> None:
    from specq.queue import QueueSettings

    work = Path(tempfile.mkdtemp(prefix="specq_drills_"))
    private_redis, private_postgres = PrivateRedis(work / "redis"), PrivatePostgres()
    private_redis.start()
    private_postgres.start()
    services = Services(private_postgres.admin_url, private_redis.url())
    target, draft = model_pair(args.models, work)
    path = work / "in.jsonl"
    write_input(path, args.requests)
    timings = DRILL_ENV if args.fast else {}

    overrides: dict[str, Any] = {k[6:].lower(): float(v) for k, v in timings.items()}  # SPECQ_LEASE_S -> lease_s
    settings = QueueSettings(**overrides)
    services.create()
    results: list[Drill] = []
    baseline = 0.0
    try:
        env = services.env(work / "home", **timings)
        with workers(env, 2, work) as fleet:
            say("baseline: no fault")
            job_id, _ = submit(env, path, target, draft, args.batch_size)
            baseline = wait_done(env, job_id, args.timeout)

            def start_job() -> tuple[str, int]:
                job_id, _ = submit(env, path, target, draft, args.batch_size)
                third = args.requests // 5
                seconds_until(lambda: progress(env, job_id)[1] >= third, args.timeout, "progress", 0.02)
                return job_id, progress(env, job_id)[1]

            if "kill" in args.only:
                kill_drill(args, services, env, fleet, work, start_job, results)
            if "redis" in args.only:
                redis_drill(args, services, env, start_job, results, private_redis.restart)
            if "postgres" in args.only:
                postgres_drill(args, services, env, start_job, results, private_postgres.restart)
    finally:
        services.drop()
        private_redis.stop()
        private_postgres.remove()
        if args.keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    report_drills(args, settings, baseline, results)


def kill_drill(
    args: argparse.Namespace,
    services: Services,
    env: dict[str, str],
    fleet: list[SpecqWorker],
    work: Path,
    start_job: Any,
    results: list[Drill],
) -> None:
    say("drill: kill -9 of a worker mid-batch")
    job_id, at = start_job()
    began = time.monotonic()
    while True:  # freeze the busiest worker; kill it only if it still holds leases once frozen
        victim = max(fleet, key=lambda w: owner_count(services.db_url, job_id, w.proc.pid))
        victim.proc.send_signal(signal.SIGSTOP)
        time.sleep(0.3)  # what it had already sent the database is applied by now
        held = owner_count(services.db_url, job_id, victim.proc.pid)
        if held:
            break
        victim.proc.send_signal(signal.SIGCONT)
        if progress(env, job_id)[0] == "completed":
            raise SystemExit("the job ended before a worker was caught mid-batch; give more --requests")
    victim.stop(signal.SIGKILL, timeout=120)
    requeued = seconds_until(
        lambda: owner_count(services.db_url, job_id, victim.proc.pid) == 0, args.timeout, "requeue"
    )
    wait_done(env, job_id, args.timeout)
    results.append(
        Drill(
            "worker killed (SIGKILL) mid-batch",
            at,
            requeued,
            f"{held} requests leased to the dead worker, requeued by the other's sweeper",
            time.monotonic() - began,
            counts(services.db_url, job_id),
        )
    )
    fleet.remove(victim)
    replacement = SpecqWorker(env, work / "worker-replacement.log")
    fleet.append(replacement)
    replacement.wait_ready(timeout=180)


def redis_drill(
    args: argparse.Namespace,
    services: Services,
    env: dict[str, str],
    start_job: Any,
    results: list[Drill],
    restart_redis: Callable[[], float],
) -> None:
    import redis

    from specq.queue import CHUNK_QUEUE_KEY

    client = redis.Redis.from_url(services.redis_url)

    def moving_again(job_id: str) -> Callable[[], bool]:
        def check() -> bool:
            try:
                return client.llen(CHUNK_QUEUE_KEY) > 0 or progress(env, job_id)[0] == "completed"
            except redis.RedisError:
                return False

        return check

    title = "Redis restarted mid-job (every message lost)"
    sign = "lost chunks back on the queue"
    restart_drill(args, services, env, start_job, results, "Redis", restart_redis, moving_again, sign, title)


def postgres_drill(
    args: argparse.Namespace,
    services: Services,
    env: dict[str, str],
    start_job: Any,
    results: list[Drill],
    restart_postgres: Callable[[], float],
) -> None:
    def new_results(job_id: str) -> Callable[[], bool]:
        before = progress(env, job_id)[1]
        return lambda: progress(env, job_id)[1] > before or progress(env, job_id)[0] == "completed"

    restart_drill(args, services, env, start_job, results, "PostgreSQL", restart_postgres, new_results, "new results")


def restart_drill(
    args: argparse.Namespace,
    services: Services,
    env: dict[str, str],
    start_job: Any,
    results: list[Drill],
    service: str,
    restart: Callable[[], float],
    recovered_when: Callable[[str], Callable[[], bool]],
    sign: str,
    title: str | None = None,
) -> None:
    """Restart `service` mid-job; time until `recovered_when(job_id)` holds (`sign` says what it sees)."""
    say(f"drill: {service} restarted mid-job")
    job_id, at = start_job()
    began = time.monotonic()
    down_s = restart()
    recovered = seconds_until(recovered_when(job_id), args.timeout, sign)
    wait_done(env, job_id, args.timeout)
    results.append(
        Drill(
            title or f"{service} restarted mid-job",
            at,
            recovered,
            f"{service} down {down_s:.1f} s; {sign} {recovered:.1f} s after it returned",
            time.monotonic() - began,
            counts(services.db_url, job_id),
        )
    )


def report_drills(args: argparse.Namespace, settings: Any, baseline: float, results: list[Drill]) -> None:
    mode = "--fast (lease 3 s, heartbeat 0.5 s, sweep 1 s)" if args.fast else "the default timings"
    print(
        f"""
### Drills: `python benchmarks/load_run.py drills --requests {args.requests}{" --fast" if args.fast else ""}`

({time.strftime("%Y-%m-%d")}; two `specq worker --device cpu` processes, {mode}: heartbeat
{settings.heartbeat_s:g} s, lease {settings.lease_s:g} s, sweep {settings.sweep_s:g} s, lost-message check after
{settings.lost_after:g} s. Jobs of {args.requests} greedy requests of 2 to 4 tokens, the same job
taking {baseline:.1f} s with no fault; each fault hit once a fifth of its job was done.)

| drill | recovery | job time | lost | duplicated | requests claimed twice | what happened |
| --- | --- | --- | --- | --- | --- | --- |"""
    )
    for d in results:
        f = d.found
        assert f["state"] == "completed" and f["lost"] == 0 and f["counters_agree"], f
        print(
            f"| {d.name} | {d.recovered_s:.1f} s | {d.job_s:.1f} s | {f['lost']} | {f['duplicated']} | "
            f"{f['claimed_again']} | {d.detail} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("load", "drills", "submit", "warm"))
    parser.add_argument("--requests", type=int, help="requests in the job (load: 20000, drills: 3000)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, help="engine batch size (load, drills: 32; warm: 8)")
    parser.add_argument("--threads", type=int, default=2, help="warm: torch threads of the worker and of specq run")
    parser.add_argument("--models", choices=("tiny", "demo"), help="model pair (warm: demo; else tiny)")
    parser.add_argument("--fast", action="store_true", help="drills: 3 s leases instead of the defaults")
    parser.add_argument("--only", default="kill,redis,postgres", help="drills: which ones, comma-separated")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (worker logs) and say where")
    parser.add_argument("--pg-admin-url", default=PG_ADMIN_URL)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args()
    if args.requests is None:
        args.requests = {"load": 20000, "drills": 3000, "submit": 1_000_000, "warm": 256}[args.what]
    if args.models is None:
        args.models = "demo" if args.what == "warm" else "tiny"
    if args.batch_size is None:
        args.batch_size = 8 if args.what == "warm" else 32
    os.chdir(Path(__file__).resolve().parent.parent)
    {"load": load, "drills": drills, "submit": submit_rate, "warm": warm}[args.what](args)


if __name__ == "__main__":
    main()
