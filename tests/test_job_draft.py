"""`submit --draft train:N`: a job that trains a draft head on its own first N completions and speculates
with it for the rest (jobs/draft_training.py, worker/trained_draft.py, distill/job_head.py)."""

from __future__ import annotations

import json
import signal
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from specq.db.models import Job, Request, Result, TrainedDraft
from specq.db.session import open_database
from specq.db.states import RequestState
from specq.db.types import utcnow
from tests.fleet_helpers import DRILL_ENV, wait_for
from tests.services import (
    count_rows,
    invoke,
    job_status,
    reference_greedy,
    services_env,
    submit_job,
    wait_state,
    write_requests,
)

LINES = [
    {"id": f"q{i}", "prompt": f"def f{i}(x): return x * {i} +", "max_tokens": 12, "temperature": 0} for i in range(24)
]


def _draft_tokens_by_seq(db_url: str, job_id: str) -> dict[int, int]:
    with open_database(db_url).session() as session:
        rows = session.execute(
            select(Request.seq, Result.draft_tokens)
            .join(Result, Result.request_id == Request.id)
            .where(Request.job_id == job_id)
        )
        return {seq: tokens for seq, tokens in rows}


def _trained_row(db, job_id: str) -> TrainedDraft:
    with db.session() as session:
        row = session.get(TrainedDraft, job_id)
        assert row is not None
        session.expunge(row)
        return row


def _exported_tokens(env: dict, job_id: str, tmp_path) -> dict[str, list[int]]:
    out = tmp_path / "out.jsonl"
    assert invoke(["export", job_id, "-o", str(out)], env).exit_code == 0
    return {r["id"]: r["tokens"] for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}


@pytest.mark.parametrize(
    ("model_free", "compile"), [(None, "auto"), ("suffix", "auto"), (None, "on")], ids=["head", "hybrid", "compiled"]
)
def test_a_job_trains_its_draft_on_its_first_requests_and_speculates_on_the_rest_losslessly(
    tiny_pair, tmp_path, model_free, compile
):
    # compiled: the head reads the states the compiled target's graphs return (the graphs inductor would
    # take, without its code generation)
    env = {"SPECQ_HOME": str(tmp_path / "home"), "SPECQ_COMPILE_BACKEND": "aot_eager"}
    path = write_requests(tmp_path / "in.jsonl", LINES)
    # K fixed: an adaptive policy may rest a head as weak as one trained on 8 tiny completions
    args = ["submit", path, "--target", tiny_pair[0], "--draft", "train:8:20k", "--fixed-k", "--batch-size", "4"]
    args += ["--compile", compile]
    if model_free is not None:  # the hybrid: the trained head beside the suffix index
        args += ["--model-free", model_free]
    result = invoke([*args, "--wait"], env)
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip()

    info = job_status(env, job_id)
    assert (info["state"], info["completed"], info["draft"]) == ("completed", 24, None)
    training = info["draft_training"]
    assert training["asked"] == "train:8:20k" and training["state"] == "ready" and training["trained_on"] == 8
    assert training["steps"] > 0 and "error" not in training
    assert info["num_draft_tokens"] > 0 and info["acceptance_by_proposer"]["draft"]["draft_tokens"] > 0

    assert info["model_free"] == model_free
    drafted = _draft_tokens_by_seq(f"sqlite:///{tmp_path / 'home' / 'specq.db'}", job_id)
    if model_free is None:
        assert all(drafted[seq] == 0 for seq in range(8))  # the target alone decoded what it trains on
    assert sum(drafted[seq] for seq in range(8, 24)) > 0
    # the head speculates, and greedy outputs stay the target's own, token for token
    assert _exported_tokens(env, job_id, tmp_path) == reference_greedy(tiny_pair[0], LINES)
    shown = invoke(["status", job_id], env)
    assert "draft_training" in shown.stdout and "state ready" in shown.stdout, shown.stdout


def test_train_n_is_refused_where_it_is_malformed_or_leaves_nothing_to_speculate_on(tiny_pair, tmp_path, sqlite_url):
    path = write_requests(tmp_path / "in.jsonl", LINES)
    submit = ["submit", path, "--target", tiny_pair[0], "--database-url", sqlite_url]

    result = invoke([*submit, "--draft", "train:24"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[0] == (
        f"{path}: --draft train:24:200k trains on the first 24 requests and speculates on the rest, "
        "but the file has 24: give N below 24"
    )
    assert count_rows(sqlite_url, Job) == 0 and count_rows(sqlite_url, Request) == 0

    for draft, reason in [
        ("train:x", "give train:N or train:N:BUDGET"),
        ("train:0", "needs N >= 1"),
        ("train:8:soon", "is not a budget"),
    ]:
        result = invoke([*submit, "--draft", draft])
        assert result.exit_code == 2 and reason in result.stderr, (draft, result.output)
    assert count_rows(sqlite_url, Job) == 0

    result = invoke(["run", path, "--target", tiny_pair[0], "--draft", "train:8", "-o", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and "use `specq submit`" in result.stderr, result.output


def test_a_draft_that_cannot_train_fails_alone_and_the_job_completes_with_the_target(tiny_pair, tmp_path):
    env = {"SPECQ_HOME": str(tmp_path / "home")}
    # one-token completions: no chain to train a head on
    lines = [{**line, "max_tokens": 1} if i < 4 else line for i, line in enumerate(LINES[:12])]
    path = write_requests(tmp_path / "in.jsonl", lines)
    result = invoke(["submit", path, "--target", tiny_pair[0], "--draft", "train:4", "--wait"], env)
    assert result.exit_code == 0, result.output
    info = job_status(env, result.stdout.strip())
    assert (info["state"], info["completed"], info["num_draft_tokens"]) == ("completed", 12, 0)
    assert info["draft_training"]["state"] == "failed"
    assert "two tokens long" in info["draft_training"]["error"]
    assert _exported_tokens(env, result.stdout.strip(), tmp_path) == reference_greedy(tiny_pair[0], lines)


def test_one_worker_trains_a_jobs_draft_and_another_takes_it_over_only_once_its_claim_lapses(
    any_db_url, tiny_pair, tmp_path
):
    from specq.jobs.control import cancel_job
    from specq.jobs.draft_training import DraftTraining
    from specq.jobs.settings import JobSettings
    from specq.jobs.submit import JobSpec
    from specq.jobs.submit import submit_job as store_job
    from specq.worker.context import WorkerContext
    from specq.worker.trained_draft import READY, TRAINING, claim_training, finish_training, renew_training

    path = write_requests(tmp_path / "in.jsonl", LINES)
    spec = JobSpec(tiny_pair[0], None, JobSettings(draft_training=DraftTraining(8)))
    submitted = store_job(path, spec, database_url=any_db_url)  # stored, not run: no broker, no caller running it
    job_id, db = submitted.job_id, submitted.db
    first, second = WorkerContext(db, "first", "cpu"), WorkerContext(db, "second", "cpu")
    clock = [utcnow()]

    def now():
        return clock[0]

    assert not claim_training(first, job_id, 8, now)  # its first 8 requests are still queued
    with db.session() as session:
        session.execute(update(Request).where(Request.job_id == job_id, Request.seq < 8).values(state="completed"))
    assert claim_training(first, job_id, 8, now)
    assert not claim_training(second, job_id, 8, now)  # the first one's claim holds
    clock[0] += timedelta(seconds=first.config.queue.lease_s - 1)
    assert not claim_training(second, job_id, 8, now)
    clock[0] += timedelta(seconds=2)  # the first one stopped renewing it: a dead trainer
    assert claim_training(second, job_id, 8, now)
    assert renew_training(second, job_id, now)

    finish_training(first, job_id, state=READY, now=now)  # too late: the second one holds it
    row = _trained_row(db, job_id)
    assert (row.state, row.owner) == (TRAINING, "second")
    finish_training(second, job_id, state=READY, now=now)
    assert _trained_row(db, job_id).state == READY
    assert not claim_training(first, job_id, 8, now)  # trained: nothing to claim
    cancel_job(db, job_id)
    assert not renew_training(second, job_id, now)  # a trainer of a cancelled job stops


def test_a_worker_killed_while_it_trains_the_draft_costs_time_never_a_result(
    pg_db_url, redis_url, tiny_pair, tmp_path, start_worker
):
    env = services_env(pg_db_url, redis_url, tmp_path / "home", **DRILL_ENV)
    path = write_requests(tmp_path / "in.jsonl", LINES)
    victim = start_worker(env)
    # a time budget long enough to kill the worker in the middle of it
    job_id = submit_job(env, path, "--target", tiny_pair[0], "--draft", "train:8:6s", "--fixed-k", "--batch-size", "4")
    db = open_database(pg_db_url)

    def training_row():
        with db.session() as session:
            row = session.get(TrainedDraft, job_id)
            return row is not None and row.state == "training"

    wait_for(training_row, 60, "the worker training the job's draft", poll=0.02)
    victim.stop(signal.SIGKILL)

    def claim_lapsed():
        with db.session() as session:
            row = session.get(TrainedDraft, job_id)
            return row is not None and row.lease_expires_at is not None and row.lease_expires_at < utcnow()

    # the heir starts once the dead trainer's claim has lapsed, however fast it starts: so it is the heir
    # that trains again, not a chunk it ran target-only while the claim still held
    wait_for(claim_lapsed, 30, "the killed trainer's claim to lapse")
    heir = start_worker(env)
    info = wait_state(env, job_id, {"completed", "failed", "cancelled"})
    assert "stopped renewing its claim; training here" in heir.output()  # trained again, from the start
    assert (info["state"], info["completed"], info["failed"]) == ("completed", 24, 0), info
    assert info["draft_training"]["state"] == "ready"
    assert (_trained_row(db, job_id).report or {}).get("sequences") == 8
    with db.session() as session:
        states = session.scalars(select(Request.state).where(Request.job_id == job_id)).all()
    assert set(states) == {RequestState.COMPLETED}
    assert count_rows(pg_db_url, Result) == 24  # one result each: none lost, none twice
    assert sum(_draft_tokens_by_seq(pg_db_url, job_id).values()) > 0
    assert _exported_tokens(env, job_id, tmp_path) == reference_greedy(tiny_pair[0], LINES)


def test_the_job_heads_teacher_is_the_distribution_draft_train_records_from_the_engine(target):
    import torch

    from specq.decoding.types import GenerationRequest, SamplingParams
    from specq.distill.corpus import Prompt, decode_with_target
    from specq.distill.head import target_states
    from specq.distill.job_head import with_teacher
    from tests.tiny_models import IdTokenizer

    greedy = SamplingParams(max_tokens=10, temperature=0)
    prompts = [Prompt(i + 1, GenerationRequest(i, tuple(range(3 + i, 9 + 2 * i)), greedy)) for i in range(3)]
    recorded = decode_with_target(target, IdTokenizer(), prompts, batch_size=2, top_k=20)
    computed = with_teacher(target, target_states(target, recorded))
    assert computed.top_ids is not None and computed.top_logprobs is not None
    assert torch.equal(computed.top_ids, torch.tensor([ids for s in recorded for ids in s.top_ids or ()]))
    wanted = torch.tensor([values for s in recorded for values in s.top_logprobs or ()])
    assert torch.equal(torch.isinf(computed.top_logprobs), torch.isinf(wanted))
    assert torch.allclose(computed.top_logprobs[wanted.isfinite()], wanted[wanted.isfinite()], atol=1e-4)
