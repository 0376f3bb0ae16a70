"""The misconfigured-worker drill of docs/reliability.md: workers that cannot serve never fail a request.

    python benchmarks/misconfigured_drill.py [--requests 600]

1. bad device: `specq autoscale --min 2 --max 2 --devices cpu,cuda:3` on a host without cuda:3 (this
   drill refuses to run where cuda:3 exists). The cuda:3 workers exit 3 before consuming; after
   `--give-up-after 3` failed starts the autoscaler gives the device up and places both workers on the
   CPU. Figures: the seconds from the autoscaler's start to the give-up line, the failed starts, and
   the job's requests failed / lost / duplicated.
2. weights gone: the job's target folder loses its weights; a worker claims a chunk, cannot load the
   model, gives the chunk back and exits 4; the weights come back and a good worker runs the job.
   Figures: the exit code, the seconds from the worker's start to its exit, the requests stored
   meanwhile (0), and the job's requests failed / lost / duplicated.

Services, models and counting are benchmarks/load_run.py's (a throwaway PostgreSQL database, the Redis
database `--redis-url`, the tiny model pair of the tests, real worker processes on the CPU). It prints
a Markdown section on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.load_run import SPECQ, TERMINAL, Services, counts, model_pair, say, submit, wait_done, write_input
from tests.fleet_helpers import DRILL_ENV, pid_alive
from tests.services import PG_ADMIN_URL, SpecqWorker, job_status

GIVE_UP_AFTER = 3


def bad_device_drill(args: argparse.Namespace, env: dict[str, str], work: Path, target: str, draft: str) -> dict:
    path = work / "bad-device.jsonl"
    write_input(path, args.requests, seed=1)
    job_id, _ = submit(env, path, target, draft, args.batch_size)
    log_path = work / "autoscale.log"
    command = [
        *SPECQ,
        "autoscale",
        *("--min", "2", "--max", "2", "--devices", "cpu,cuda:3", "--interval", "0.5", "--cooldown", "600"),
        *("--give-up-after", str(GIVE_UP_AFTER), "--metrics-port", "0", "--log-dir", str(work / "workers")),
    ]
    say(f"bad device: job {job_id}, {args.requests} requests; autoscaler on cpu,cuda:3")
    began = time.monotonic()
    with open(log_path, "wb") as log:
        scaler = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            given_up_s = job_s = None
            deadline = time.monotonic() + args.timeout
            while given_up_s is None or job_s is None:  # whichever comes first
                if given_up_s is None and "giving up device cuda:3" in log_path.read_text():
                    given_up_s = time.monotonic() - began
                    say(f"cuda:3 given up after {given_up_s:.1f}s")
                if job_s is None and job_status(env, job_id)["state"] in TERMINAL:
                    job_s = time.monotonic() - began
                    say(f"job ended after {job_s:.1f}s")
                if time.monotonic() > deadline:
                    raise AssertionError(f"no give-up line or no job end after {args.timeout}s")
                time.sleep(0.1)
        finally:
            scaler.send_signal(signal.SIGTERM)
            scaler.wait(120)
    text = log_path.read_text()
    pids = [int(p) for p in re.findall(r"started worker \d+ \(pid (\d+)\)", text)]
    assert not any(map(pid_alive, pids)), "a worker outlived the autoscaler"
    return {
        "given_up_s": given_up_s,
        "job_s": job_s,
        "failed_starts": len(re.findall(r"on cuda:3 exited by itself \(exit 3\)", text)),
        "give_up_lines": text.count("giving up device cuda:3"),
        "found": counts(env["SPECQ_DATABASE_URL"], job_id),
    }


def weights_gone_drill(args: argparse.Namespace, env: dict[str, str], work: Path, target: str, draft: str) -> dict:
    path = work / "weights-gone.jsonl"
    write_input(path, args.requests, seed=2)
    job_id, _ = submit(env, path, target, draft, args.batch_size)
    hidden = work / "hidden"
    hidden.mkdir()
    weights = [p for p in Path(target).iterdir() if p.suffix == ".safetensors"]
    for weight in weights:
        weight.rename(hidden / weight.name)
    say(f"weights gone: job {job_id}; a worker without the target's weights")
    began = time.monotonic()
    bad = SpecqWorker(env, work / "no-weights.log")
    code = bad.proc.wait(args.timeout)
    exit_s = time.monotonic() - began
    bad.stop()
    stored_meanwhile = counts(env["SPECQ_DATABASE_URL"], job_id)["results"]
    for weight in weights:
        (hidden / weight.name).rename(Path(target) / weight.name)
    say(f"exit {code} after {exit_s:.1f}s; {stored_meanwhile} results stored; weights back, a good worker")
    good = SpecqWorker(env, work / "good.log").wait_ready(timeout=180)
    try:
        job_s = wait_done(env, job_id, args.timeout)
    finally:
        good.stop(timeout=120)
    return {
        "exit": code,
        "exit_s": exit_s,
        "stored_meanwhile": stored_meanwhile,
        "line": next((line for line in bad.output().splitlines() if "cannot load the models" in line), ""),
        "job_s": job_s,
        "found": counts(env["SPECQ_DATABASE_URL"], job_id),
    }


def outcome(found: dict[str, Any]) -> str:
    return (
        f"{found['completed']} completed, {found['failed']} failed, {found['lost']} lost, "
        f"{found['duplicated']} duplicated (job {found['state']}, counters agree: {found['counters_agree']})"
    )


def report(args: argparse.Namespace, device: dict, weights: dict) -> None:
    print(f"### Misconfigured workers ({args.requests} requests a job, tiny pair, CPU workers)\n")
    print("| drill | figure |\n| --- | --- |")
    print(f"| bad device: requests | {outcome(device['found'])} |")
    print(f"| bad device: cuda:3 given up after | {device['given_up_s']:.1f} s from the autoscaler's start |")
    print(f"| bad device: failed starts on cuda:3 (exit 3) | {device['failed_starts']}, one give-up line |")
    print(f"| bad device: job ended after | {device['job_s']:.1f} s from the autoscaler's start |")
    print(f"| weights gone: the worker | exit {weights['exit']} after {weights['exit_s']:.1f} s |")
    print(f"| weights gone: results stored by it | {weights['stored_meanwhile']} |")
    print(f"| weights gone: requests | {outcome(weights['found'])} |")
    print(f"\nThe worker's last line: `{re.sub(r'/[^ ]*/', '.../', weights['line'].strip())}`")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--pg-admin-url", default=PG_ADMIN_URL)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args()

    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 3:
        sys.exit("this host has a cuda:3: the drill needs a device that is missing")
    work = Path(tempfile.mkdtemp(prefix="specq_misconfigured_"))
    services = Services(args.pg_admin_url, args.redis_url)
    services.create()
    try:
        tiny_target, draft = model_pair("tiny", work / "models")
        target = str(work / "target")  # a copy: the second drill takes its weights away
        shutil.copytree(tiny_target, target)
        env = services.env(work / "home", **DRILL_ENV)
        device = bad_device_drill(args, env, work, target, draft)
        weights = weights_gone_drill(args, env, work, target, draft)
    finally:
        services.drop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, device, weights)


if __name__ == "__main__":
    main()
