"""The store: migrations match the models, states, claims, idempotent results, job end (SQLite and PostgreSQL)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from sqlalchemy import func, select, update
from sqlalchemy.exc import InvalidRequestError

from specq.cli.main import _register, cli
from specq.db.migrate import alembic_config, head_revision, open_migrated
from specq.db.models import Base, Batch, Job, Request, Result
from specq.db.session import SCHEMA_HEAD, current_revision, mask_url, open_database
from specq.db.states import (
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    REQUEST_TRANSITIONS,
    JobState,
    RequestState,
    job_sources,
)
from specq.decoding.types import GenerationResult
from specq.errors import ServiceUnavailableError
from specq.jobs.inputs import RequestSpec
from specq.jobs.store import insert_requests
from specq.worker.claims import claim_chunk, renew_leases, requeue_expired
from specq.worker.results import store_results

_register()


def make_job(db, n: int, job_id: str = "job1", chunk_size: int = 4) -> str:
    with db.session() as session:
        session.add(
            Job(
                id=job_id,
                state=JobState.QUEUED,
                target="t",
                draft=None,
                input_name="in.jsonl",
                settings={"chunk_size": chunk_size, "sampling": {}, "decoding": {}},
                total=n,
            )
        )
        session.flush()
        specs = [RequestSpec(i + 1, f"r{i}", "completion", f"prompt {i}", None, {"max_tokens": 3}) for i in range(n)]
        insert_requests(session, job_id, specs)
    return job_id


def ok(request_id: int, tokens: int = 3) -> GenerationResult:
    return GenerationResult(
        key=request_id,
        token_ids=[1] * tokens,
        text="x" * tokens,
        finish_reason="length",
        prompt_tokens=2,
        completion_tokens=tokens,
        draft_tokens=4,
        accepted_tokens=2,
    )


def bad(request_id: int) -> GenerationResult:
    return GenerationResult(
        key=request_id,
        token_ids=[],
        text="",
        finish_reason=None,
        prompt_tokens=2,
        completion_tokens=0,
        error="too long",
    )


def test_single_head_named_in_the_code() -> None:
    assert ScriptDirectory.from_config(alembic_config()).get_heads() == [SCHEMA_HEAD]


def test_models_match_migrations(any_db_url) -> None:
    db = open_migrated(any_db_url)
    assert current_revision(db) == head_revision()
    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []


def test_db_upgrade_command(sqlite_url) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["db", "upgrade", "--database-url", sqlite_url])
    assert result.exit_code == 0, result.output
    assert "migrated from empty to" in result.output
    result = runner.invoke(cli, ["db", "upgrade"], env={"SPECQ_DATABASE_URL": sqlite_url})
    assert result.exit_code == 0, result.output
    assert "already at revision" in result.output


def test_read_only_commands_never_migrate(sqlite_url, tmp_path) -> None:
    runner = CliRunner()
    env = {"SPECQ_DATABASE_URL": sqlite_url}
    for args, code, output in (
        (["status", "--json"], 0, "[]"),
        (["workers", "--json"], 0, "[]"),
        (["status", "nope"], 2, "no job has the id 'nope'"),
        (["export", "nope", "-o", str(tmp_path / "x.csv")], 2, "no job has the id 'nope'"),
        (["cancel", "nope"], 2, "no job has the id 'nope'"),
    ):
        result = runner.invoke(cli, args, env=env)
        assert result.exit_code == code and output in result.output, (args, result.output)
    db = open_database(sqlite_url)
    assert current_revision(db) is None  # an empty database reads as holding nothing, and stays empty
    open_migrated(sqlite_url)
    with db.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '0001'")
    result = runner.invoke(cli, ["status"], env=env)
    assert result.exit_code == 1 and "run `specq db upgrade`" in result.output, result.output
    assert current_revision(db) == "0001"


def test_database_down_is_one_sentence_with_masked_password() -> None:
    url = "postgresql+psycopg://postgres:s3cret@127.0.0.1:1/specq"
    with pytest.raises(ServiceUnavailableError) as info:
        open_database(url)
    assert "s3cret" not in str(info.value) and "***" in str(info.value)
    result = CliRunner().invoke(cli, ["db", "upgrade", "--database-url", url])
    assert result.exit_code == 1, result.output
    assert "cannot reach the database at postgresql+psycopg://postgres:***@127.0.0.1:1/specq" in result.output
    assert "s3cret" not in result.output and "Traceback" not in result.output
    assert mask_url("sqlite:///x.db") == "sqlite:///x.db"


def test_transition_table_is_complete() -> None:
    assert set(JOB_TRANSITIONS) == set(JobState)
    assert set(REQUEST_TRANSITIONS) == set(RequestState)
    assert {JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED} == JOB_TERMINAL
    assert REQUEST_TRANSITIONS[RequestState.COMPLETED] == frozenset()
    assert sorted(job_sources(JobState.CANCELLED)) == ["queued", "running"]
    assert sorted(job_sources(JobState.QUEUED)) == ["cancelled", "completed", "expired", "failed"]
    assert sorted(job_sources(JobState.EXPIRED)) == ["queued", "running"]


def test_timestamps_are_utc_aware(any_db_url) -> None:
    db = open_migrated(any_db_url)
    make_job(db, 1)
    with db.session() as session:
        job = session.get_one(Job, "job1")
        assert job.created_at.tzinfo is not None
        assert abs(job.created_at - datetime.now(UTC)) < timedelta(minutes=1)


def test_relationships_raise_instead_of_querying(sqlite_url) -> None:
    db = open_migrated(sqlite_url)
    make_job(db, 1)
    with db.session() as session:
        job = session.get_one(Job, "job1")
        with pytest.raises(InvalidRequestError):
            _ = job.requests


def test_bulk_insert_keeps_order_and_text(any_db_url) -> None:
    db = open_migrated(any_db_url)
    nasty = 'tab\t, newline\n, backslash \\ quote " \\N unicode \u2603'
    with db.session() as session:
        session.add(Job(id="j", state="queued", target="t", input_name="i", settings={"chunk_size": 2}, total=3))
        session.flush()
        specs = [
            RequestSpec(1, "a", "completion", nasty, None, {"stop": ("\n", "x"), "temperature": 0.0}),
            RequestSpec(3, "b", "chat", None, [{"role": "user", "content": nasty}], {}),
            RequestSpec(4, "c", "completion", "p", None, {}),
        ]
        assert insert_requests(session, "j", specs) == 3
    with db.session() as session:
        rows = session.execute(select(Request).order_by(Request.seq)).scalars().all()
        assert [(r.seq, r.line, r.custom_id, r.state) for r in rows] == [
            (0, 1, "a", "queued"),
            (1, 3, "b", "queued"),
            (2, 4, "c", "queued"),
        ]
        assert rows[0].prompt == nasty
        assert rows[0].overrides == {"stop": ["\n", "x"], "temperature": 0.0}
        assert rows[1].messages == [{"role": "user", "content": nasty}] and rows[1].prompt is None


def test_claims_are_exclusive_and_leased(any_db_url) -> None:
    db = open_migrated(any_db_url)
    make_job(db, 6)
    with db.session() as session:
        first = claim_chunk(session, "job1", 0, 4, "w1", lease_s=60)
    with db.session() as session:
        assert claim_chunk(session, "job1", 0, 4, "w2", lease_s=60) == []  # all leased by w1
        assert session.get_one(Job, "job1").state == JobState.RUNNING
    assert [c.seq for c in first] == [0, 1, 2, 3]
    # w1 runs one chunk at a time, so a lease of its own is from a run that died: it may claim it again
    with db.session() as session:
        assert len(claim_chunk(session, "job1", 0, 4, "w1", lease_s=60)) == 4
    # an expired lease belongs to a dead worker: anyone may claim it
    with db.session() as session:
        session.execute(
            update(Request).where(Request.seq == 1).values(lease_expires_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    with db.session() as session:
        again = claim_chunk(session, "job1", 0, 4, "w2", lease_s=60)
    assert [c.seq for c in again] == [1]
    with db.session() as session:
        attempts = session.scalar(select(Request.attempts).where(Request.seq == 1))
        assert attempts == 3
        assert renew_leases(session, "w1", 60) == 3


def test_concurrent_claims_never_share_a_request(pg_db_url) -> None:
    db = open_migrated(pg_db_url)
    make_job(db, 200, chunk_size=200)
    claimed: dict[str, list[int]] = {}
    barrier = threading.Barrier(4)

    def claimer(name: str) -> None:
        barrier.wait()
        got = []
        for first in range(0, 200, 10):
            with db.session() as session:
                got += [c.id for c in claim_chunk(session, "job1", first, first + 10, name, lease_s=60)]
        claimed[name] = got

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [i for got in claimed.values() for i in got]
    assert len(everything) == 200 and len(set(everything)) == 200


def test_results_are_idempotent_and_the_last_one_ends_the_job(any_db_url) -> None:
    db = open_migrated(any_db_url)
    make_job(db, 3)
    with db.session() as session:
        ids = [c.id for c in claim_chunk(session, "job1", 0, 3, "w1", lease_s=60)]
    with db.session() as session:
        assert store_results(session, "job1", [ok(ids[0]), bad(ids[1])], "w1").job_state == JobState.RUNNING
    with db.session() as session:  # the same results again (a redelivered task): nothing changes
        outcome = store_results(session, "job1", [ok(ids[0], tokens=5), bad(ids[1])], "w2")
        assert outcome.inserted == 0
    with db.session() as session:
        job = session.get_one(Job, "job1")
        assert (job.completed, job.failed, job.generated_tokens, job.state) == (1, 1, 3, JobState.RUNNING)
    with db.session() as session:
        outcome = store_results(session, "job1", [ok(ids[2])], "w1")
        assert (outcome.inserted, outcome.job_state) == (1, JobState.COMPLETED)
    with db.session() as session:
        job = session.get_one(Job, "job1")
        assert (job.completed, job.failed, job.generated_tokens) == (2, 1, 6)
        assert job.finished_at is not None
        assert session.scalar(select(func.count()).select_from(Result)) == 3
        states = session.scalars(select(Request.state).order_by(Request.seq)).all()
        assert states == ["completed", "failed", "completed"]
        assert session.scalar(select(func.count()).where(Request.lease_owner.is_not(None))) == 0


def test_job_fails_when_every_request_failed(any_db_url) -> None:
    db = open_migrated(any_db_url)
    make_job(db, 2)
    with db.session() as session:
        ids = [c.id for c in claim_chunk(session, "job1", 0, 2, "w1", lease_s=60)]
    with db.session() as session:
        assert store_results(session, "job1", [bad(i) for i in ids], "w1").job_state == JobState.FAILED


def test_sweeper_requeues_expired_leases_by_chunk(any_db_url) -> None:
    db = open_migrated(any_db_url)
    make_job(db, 10, chunk_size=4)
    with db.session() as session:
        claim_chunk(session, "job1", 0, 4, "dead", lease_s=60)
        claim_chunk(session, "job1", 8, 12, "dead", lease_s=60)
        claim_chunk(session, "job1", 4, 8, "alive", lease_s=60)
        session.execute(
            update(Request)
            .where(Request.lease_owner == "dead")
            .values(lease_expires_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    with db.session() as session:
        assert requeue_expired(session) == [("job1", 0, 4), ("job1", 8, 10)]
    with db.session() as session:
        states = dict(session.execute(select(Request.seq, Request.state)).all())
        assert [states[i] for i in range(10)] == ["queued"] * 4 + ["running"] * 4 + ["queued"] * 2
        assert requeue_expired(session) == []


def test_deleting_a_job_cascades(any_db_url) -> None:
    db = open_migrated(any_db_url)
    make_job(db, 2)
    with db.session() as session:
        ids = [c.id for c in claim_chunk(session, "job1", 0, 2, "w1", lease_s=60)]
        session.add(Batch(job_id="job1", worker="w1", device="cpu", size=2))
    with db.session() as session:
        store_results(session, "job1", [ok(i) for i in ids], "w1")
    with db.session() as session:
        session.delete(session.get_one(Job, "job1"))
    with db.session() as session:
        for model in (Request, Result, Batch):
            assert session.scalar(select(func.count()).select_from(model)) == 0
