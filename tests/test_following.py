"""What a person sees while a job runs and after (issue 35, item 5), through the commands on the real services:

- the acceptance shows while a batch runs (its draft counters are written with its results), in
  `submit --wait`, `specq wait` and `status`, embedded and on the queue;
- target-only work says `n/a` for acceptance, never a rate of 0; a line with `n` > 1 counts its
  completions against requests, not lines; `1 chunk`, not `1 chunks`;
- `status` shows acceptance by proposer as a table of the proposers that ran; `status` and `workers`
  print every cell whole when stdout is not a terminal;
- `cancel` says what happens to queued requests and to those workers hold;
- `specq wait JOB [--timeout S]` follows a job with the exit codes of `submit --wait`;
- with no live worker, the wait says so and that an autoscaler, if one runs, starts one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import select, update

from specq.db.models import Batch, Request, Worker
from specq.db.session import open_database
from specq.db.states import RequestState
from specq.db.types import utcnow
from tests.services import invoke, job_status, services_env, submit_job, write_requests

LINES: list[dict[str, Any]] = [
    {"id": f"q{i}", "prompt": f"def f{i}(a, b):", "max_tokens": 6, "temperature": 0} for i in range(3)
]


@pytest.fixture
def embedded(tmp_path):
    return services_env(f"sqlite:///{tmp_path / 'specq.db'}", None, tmp_path / "home")


@pytest.fixture
def queued(pg_db_url, redis_url, tmp_path):
    return services_env(pg_db_url, redis_url, tmp_path / "home")


def test_a_running_batch_writes_its_acceptance_with_its_results(embedded, tiny_pair, tmp_path, monkeypatch) -> None:
    import specq.worker.chunk as chunk

    seen: list[tuple[int, bool]] = []  # (draft tokens, batch ended) of the batch, at each store of results
    store_results = chunk.store_results

    def watching(session, job_id, results, worker):
        (row,) = session.execute(select(Batch.num_draft_tokens, Batch.ended_at).where(Batch.job_id == job_id)).all()
        seen.append((row.num_draft_tokens, row.ended_at is not None))
        return store_results(session, job_id, results, worker)

    monkeypatch.setattr(chunk, "store_results", watching)
    monkeypatch.setattr(chunk, "FLUSH_SECONDS", 0.0)  # every result is stored as it comes
    path = write_requests(tmp_path / "in.jsonl", LINES)
    args = ["--target", tiny_pair[0], "--draft", tiny_pair[1], "--batch-size", "1", "--fixed-k", "--wait"]
    result = invoke(["submit", path, *args], embedded)
    assert result.exit_code == 0, result.output
    # one engine run over the three requests: the first two results are stored while it runs
    assert len(seen) == 3 and not seen[0][1] and not seen[1][1], seen
    assert seen[0][0] > 0, "the first result was stored without the batch's draft counters so far"
    assert seen[1][0] >= seen[0][0]


def test_status_reads_a_running_batchs_acceptance(queued, tiny_pair, tmp_path) -> None:
    from specq.decoding.stats import EngineStats
    from specq.worker.results import record_batch_progress, start_batch

    job_id = submit_job(queued, write_requests(tmp_path / "in.jsonl", LINES), "--target", tiny_pair[0])
    db = open_database(queued["SPECQ_DATABASE_URL"])
    stats = EngineStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=9, accepted_per_position=[4, 3, 2])
    stats.by_proposer["draft"].update(drafts=4, draft_tokens=12, accepted_tokens=9)
    with db.session() as session:
        batch_id = start_batch(session, job_id, "w@test", "cpu", 3)
        record_batch_progress(session, batch_id, stats)
    status = job_status(queued, job_id)
    assert status["acceptance_rate"] == 0.75 and status["num_draft_tokens"] == 12
    assert status["acceptance_per_position"] == [1.0, 0.75, 0.5]
    assert status["engine_tokens_per_second"] == 0.0  # the batch has not ended: no engine time yet


def test_target_only_says_na_and_a_line_with_n_counts_its_choices(embedded, tiny_pair, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x = ", "max_tokens": 4, "n": 2}])
    result = invoke(["run", path, "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair[0]], embedded)
    assert result.exit_code == 0, result.output
    assert "2 completed, 0 failed of 2 requests from 1 line;" in result.stderr
    assert "acceptance n/a" in result.stderr and "acceptance rate" not in result.stderr

    one = write_requests(tmp_path / "one.jsonl", LINES[:1])
    result = invoke(["submit", one, "--target", tiny_pair[0]], embedded)
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip()
    assert f"job {job_id}: 1 request in 1 chunk, running here" in result.stderr
    assert "acceptance n/a" in result.stderr and "acceptance rate" not in result.stderr
    shown = invoke(["status", job_id], embedded)
    assert shown.exit_code == 0, shown.output
    fields = dict(line.split(None, 1) for line in shown.stdout.splitlines())
    assert fields["acceptance_rate"] == fields["mean_acceptance_length"] == "n/a"
    assert fields["acceptance_per_position"] == "n/a"
    assert fields["acceptance_by_proposer"] == "n/a"
    listed = invoke(["status"], embedded)
    assert listed.exit_code == 0, listed.output
    _, row = listed.stdout.splitlines()
    assert row.split()[5] == "n/a"  # id, state, done/total, failed, tok/s, acceptance, created


def test_status_shows_the_proposers_that_ran_as_a_table(embedded, tiny_pair, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES)
    result = invoke(["submit", path, "--target", tiny_pair[0], "--draft", tiny_pair[1], "--fixed-k"], embedded)
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip()
    shown = invoke(["status", job_id], embedded)
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    at = lines.index("acceptance_by_proposer")
    header = [cell.strip() for cell in lines[at + 1].split("  ") if cell.strip()]
    assert header == [
        "proposer",
        "drafts",
        "draft tokens",
        "accepted tokens",
        "acceptance rate",
    ]
    status = job_status(embedded, job_id)
    draft = status["acceptance_by_proposer"]["draft"]
    assert lines[at + 2].split() == [
        "draft",
        str(draft["drafts"]),
        str(draft["draft_tokens"]),
        str(draft["accepted_tokens"]),
        f"{draft['acceptance_rate']:.3f}",
    ]
    assert not any(line.split()[:1] in (["ngram"], ["suffix"]) for line in lines), "a proposer that never ran"
    assert "{" not in shown.stdout  # no Python dict


def test_tables_are_whole_when_stdout_is_not_a_terminal(queued, tiny_pair, tmp_path) -> None:
    job_id = submit_job(queued, write_requests(tmp_path / "in.jsonl", LINES), "--target", tiny_pair[0])
    name = "worker@" + "a-rather-long-host-name.example.internal" + ":cpu:" + "7" * 12
    db = open_database(queued["SPECQ_DATABASE_URL"])
    with db.session() as session:
        session.add(Worker(name=name, device="cpu", state="idle", host="h" * 60, pid=4242, heartbeat_at=utcnow()))
    listed = invoke(["status"], queued)
    assert listed.exit_code == 0, listed.output
    created = job_status(queued, job_id)["created_at"][:19]
    assert job_id in listed.stdout and created in listed.stdout and "…" not in listed.stdout
    workers = invoke(["workers", "--all"], queued)
    assert workers.exit_code == 0, workers.output
    assert name in workers.stdout and "…" not in workers.stdout
    assert max(len(line) for line in workers.stdout.splitlines()) > 80  # not cut to a terminal's width


def test_cancel_says_what_happens_to_queued_and_held_requests(queued, tiny_pair, tmp_path) -> None:
    job_id = submit_job(queued, write_requests(tmp_path / "in.jsonl", LINES), "--target", tiny_pair[0])
    db = open_database(queued["SPECQ_DATABASE_URL"])
    with db.session() as session:  # as a worker's claim leaves them: one request held, two queued
        held = session.scalars(select(Request.id).where(Request.job_id == job_id).order_by(Request.seq)).first()
        session.execute(
            update(Request).where(Request.id == held).values(state=RequestState.RUNNING, lease_owner="w@test")
        )
    result = invoke(["cancel", job_id], queued)
    assert result.exit_code == 0, result.output
    assert f"job {job_id} cancelled: 2 queued requests will not run; workers hold 1 request:" in result.stderr
    assert "they stop at the next result each worker stores and end cancelled" in result.stderr


def test_wait_follows_a_job_with_the_exit_codes_of_submit_wait(queued, tiny_pair, tmp_path, start_worker) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES)
    job_id = submit_job(queued, path, "--target", tiny_pair[0], "--draft", tiny_pair[1], "--fixed-k")
    # no worker yet: the wait says so, names the autoscaler, and gives up at its timeout (exit 1)
    result = invoke(["wait", job_id, "--timeout", "0.5"], queued)
    assert result.exit_code == 1, result.output
    assert "no worker is live yet" in result.stderr and "specq autoscale" in result.stderr
    assert f"gave up waiting after 0.5s: job {job_id} is queued and keeps running" in result.stderr
    worker = start_worker(queued)
    result = invoke(["wait", job_id], queued)
    assert result.exit_code == 0, result.output
    assert f"job {job_id} completed: 3 completed, 0 failed of 3" in result.stderr
    assert "acceptance rate" in result.stderr and "no worker is live" not in result.stderr
    assert result.stdout == ""  # progress and summary on stderr: stdout is a script's
    assert worker.stop() == 0, worker.output()
    # an ended job: at once, exit 0; a cancelled one, exit 1; an unknown id, exit 2
    assert invoke(["wait", job_id], queued).exit_code == 0
    other = submit_job(queued, path, "--target", tiny_pair[0])
    assert invoke(["cancel", other], queued).exit_code == 0
    cancelled = invoke(["wait", other], queued)
    assert cancelled.exit_code == 1, cancelled.output
    assert f"job {other} cancelled" in cancelled.stderr and "3 did not run" in cancelled.stderr
    unknown = invoke(["wait", "no-such-job"], queued)
    assert unknown.exit_code == 2, unknown.output
    assert invoke(["wait", job_id, "--timeout", "0"], queued).exit_code == 2


def test_submit_wait_names_the_autoscaler_when_no_worker_is_live(queued, tiny_pair, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES)
    result = invoke(["submit", path, "--target", tiny_pair[0], "--wait", "--timeout", "0.5"], queued)
    assert result.exit_code == 1, result.output
    assert "no worker is live yet" in result.stderr and "an autoscaler (`specq autoscale`)" in result.stderr
    assert json.dumps(result.stdout.strip())  # the job id alone on stdout


def test_a_narrow_terminal_drops_whole_columns_never_cuts_a_name() -> None:
    from specq.cli.tables import fitted

    name = "worker@a-rather-long-host-name.example:cpu:777777"
    columns = ["name", "device", "state", "last heartbeat", "age", "current batch", "compiled"]
    row = [name, "cpu", "idle", "2026-12-06T00:31:08", "3s", "-", "target eager, draft eager"]
    drop = ("compiled", "last heartbeat", "current batch", "age", "device")
    lines, left_out = fitted(columns, [row], drop, width=90)
    assert left_out == ["compiled", "last heartbeat"]
    assert lines[1].split() == [name, "cpu", "idle", "3s", "-"] and max(map(len, lines)) <= 90
    lines, left_out = fitted(columns, [row], drop, width=30)  # narrower than the name: the name stays whole
    assert left_out == list(drop) and lines[1].split() == [name, "idle"]
    assert fitted(columns, [row], drop, width=200) == (fitted(columns, [row], (), width=0)[0], [])
