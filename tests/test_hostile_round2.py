"""Hostile input and faults, second round (issue 36), on the real services with real workers.

1. A chat template is rendered at submit, in a sandboxed child under a time, memory and output bound:
   one that loops for ever or allocates gigabytes is a bad line (exit 2, nothing stored); a job stored
   before (its chat lines not rendered) is rendered by the worker under the same bounds, and neither
   wedges it nor starves the plain request beside it.
2. A cancelled job whose worker dies ends with its requests cancelled (the sweeper does not queue them
   again), and `retry` runs them.
3. Credential masking is linear in its input.
4. Retention deletes nothing in flight, and has a floor.
5. Export notices its job deleted while it streams.
6. A partly run `n` line exports its completed choices, in every format and filter alike.
7. `--chat-template` is bounded in size and stored nowhere.
8. The small ones.

Every wait is bounded; no verdict depends on the machine's speed (the time bounds are on loops that
never end, or generous by orders of magnitude).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, cast

import pytest
from sqlalchemy import select, update

from specq.db.models import Job, Request
from specq.db.session import open_database
from tests.fleet_helpers import DRILL_ENV, wait_for
from tests.services import (
    count_rows,
    invoke,
    job_status,
    request_states,
    services_env,
    submit_job,
    wait_state,
    write_requests,
)

HANG = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
HOG = "{{ ('x' * 10**10)|length }}"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
PLAIN = {"id": "plain", "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}


# -- 1. chat templates ----------------------------------------------------------------------------------
def test_a_template_that_hangs_or_hogs_is_a_bad_line_at_submit(pg_db_url, redis_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, redis_url, tmp_path / "home", SPECQ_CHAT_TEMPLATE_SECONDS="2")
    chats = [{"id": f"c{i}", **CHAT} for i in range(5)]
    path = write_requests(tmp_path / "in.jsonl", [PLAIN, *chats])
    for template, why in ((HANG, "took longer than 2s"), (HOG, "needs more than 1024 MiB of memory")):
        (tmp_path / "t.jinja").write_text(template)
        started = time.monotonic()
        result = invoke(["submit", path, "--target", tiny_pair[0], "--chat-template", str(tmp_path / "t.jinja")], env)
        assert result.exit_code == 2, result.output
        lines = result.stderr.splitlines()
        assert [line.split(": ", 1)[0] for line in lines[:5]] == [f"{path}:{i}" for i in range(2, 7)], result.stderr
        if template == HANG:  # three lines cut at 2 s each, the others not tried
            assert all(why in line for line in lines[:3]), result.stderr
            assert all("took longer than 2s (the limit) on 3 lines already" in line for line in lines[3:5])
        else:
            assert all(why in line for line in lines[:5]), result.stderr
        assert time.monotonic() - started < 120  # bounded: it would never end
        assert count_rows(pg_db_url, Job) == 0 and count_rows(pg_db_url, Request) == 0


def test_a_worker_renders_an_old_jobs_chat_lines_under_the_bounds(
    pg_db_url, redis_url, tiny_pair, tmp_path, start_worker
) -> None:
    """A job stored before chat lines were rendered at submit (its rows hold messages and no token ids,
    its settings the template): the worker renders under the bounds. Before, it spun for ever with its
    leases renewed, the plain request of the same chunk starved, and the next worker hung the same way."""
    env = services_env(pg_db_url, redis_url, tmp_path / "home", SPECQ_CHAT_TEMPLATE_SECONDS="2", **DRILL_ENV)
    path = write_requests(tmp_path / "in.jsonl", [{"id": "chat", **CHAT}, PLAIN])
    job_id = submit_job(env, path, "--target", tiny_pair[0], "--max-attempts", "1")
    db = open_database(pg_db_url)
    with db.session() as session:  # as an older version stored it
        job = session.get(Job, job_id)
        assert job is not None
        job.settings = {**job.settings, "chat_template": HANG}
        session.execute(update(Request).where(Request.job_id == job_id).values(prompt_token_ids=None))
    start_worker(env)
    info = wait_state(env, job_id, {"completed", "failed", "cancelled"}, timeout=120)
    assert (info["state"], info["completed"], info["failed"]) == ("completed", 1, 1), info
    exported = tmp_path / "out.jsonl"
    assert invoke(["export", job_id, "-o", str(exported), "--format", "jsonl"], env).exit_code == 0
    rows = {r["id"]: r for r in map(json.loads, exported.read_text().splitlines())}
    assert "took longer than 2s" in rows["chat"]["error"], rows["chat"]
    assert rows["plain"]["finish_reason"] in {"stop", "length"}
    # counted started before any work on it, and taken back when this living worker failed it: only a
    # worker's death counts against its attempts (issue 49)
    with db.session() as session:
        starts = session.scalar(select(Request.starts).where(Request.job_id == job_id, Request.custom_id == "chat"))
        assert starts == 0


# -- 2. a cancelled job whose worker dies ---------------------------------------------------------------
def test_a_cancelled_jobs_dead_worker_leaves_its_requests_cancelled(
    pg_db_url, redis_url, tiny_pair, tmp_path, start_worker
) -> None:
    env = services_env(pg_db_url, redis_url, tmp_path / "home", **DRILL_ENV)
    lines = [{"id": f"r{i}", "prompt": f"def f{i}(x):", "max_tokens": 48, "temperature": 0} for i in range(40)]
    path = write_requests(tmp_path / "in.jsonl", lines)
    job_id = submit_job(env, path, "--target", tiny_pair[0], "--batch-size", "1")
    db = open_database(pg_db_url)

    def running() -> int:
        with db.session() as session:
            return request_states(session, job_id).get("running", 0)

    first = start_worker(env)
    wait_for(running, 60, "the worker to claim a chunk", poll=0.05)
    os.kill(first.proc.pid, signal.SIGSTOP)  # it holds its claims, and renews them no more
    try:
        assert invoke(["cancel", job_id], env).exit_code == 0
    finally:
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
    start_worker(env)  # its sweeper finds the dead worker's leases expired

    def settled() -> dict[str, int] | None:
        with db.session() as session:
            states = request_states(session, job_id)
        return None if "running" in states else states

    states = wait_for(settled, 60, "the sweeper to settle the dead worker's requests", poll=0.2)
    assert set(states) <= {"cancelled", "completed"}, states  # before: queued under a cancelled job, for ever
    assert job_status(env, job_id)["state"] == "cancelled"

    result = invoke(["retry", job_id], env)
    assert result.exit_code == 0, result.output
    assert f"{states['cancelled']} requests requeued ({states['cancelled']} cancelled)" in result.stderr, result.output
    info = wait_state(env, job_id, {"completed", "failed", "cancelled"}, timeout=180)
    assert (info["state"], info["completed"], info["failed"]) == ("completed", 40, 0), info


# -- 3. credential masking is linear ---------------------------------------------------------------------
ADVERSARIAL = {  # 1 MB each: shapes that made the userinfo pattern backtrack from every character
    "letters": "a" * (1 << 20),
    "a scheme at the end": "a" * (1 << 20) + "://",
    "a long user": "redis://" + "u" * (1 << 20) + ":",
    "a long password": "redis://u:" + "c" * (1 << 20),
    "secret names": "password" * (1 << 17),
    "scheme characters": "a.-+" * (1 << 18),
    "schemes": "a://a:" * (1 << 17),
}


def test_masking_is_linear_on_adversarial_text() -> None:
    """Each 1 MB text is masked in a child allowed 5 s of CPU time (it takes well under one; before, the
    quadratic pattern needed hours): CPU time, so a busy machine does not change the verdict."""
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_CPU, (5, 5))\n"
        "from specq.masking import mask_text\n"
        "mask_text(sys.stdin.read())\n"
    )
    for shape, text in ADVERSARIAL.items():
        done = subprocess.run([sys.executable, "-c", code], input=text, text=True, capture_output=True, timeout=300)
        assert done.returncode == 0, f"{shape}: {done.returncode} {done.stderr[-500:]}"


def test_masking_still_finds_credentials_after_any_prefix() -> None:
    from specq.masking import mask_text

    for text, masked in (
        ("1redis://u:secret@h/0", "1redis://u:***@h/0"),
        ("x_postgresql://a:b@h", "x_postgresql://a:***@h"),
        ("see postgresql+psycopg://user:p@ss@w@host/db ok", "see postgresql+psycopg://user:***@host/db ok"),
        ("(redis://:pw@host:6379/0)", "(redis://:***@host:6379/0)"),
    ):
        assert mask_text(text) == masked


# -- 4. retention ----------------------------------------------------------------------------------------
def test_retention_deletes_nothing_in_flight_and_has_a_floor(
    pg_db_url, redis_url, tiny_pair, tmp_path, monkeypatch
) -> None:
    """An expired job whose requests still run under a worker's live leases is kept (before: deleted,
    and the worker's results were lost with an IntegrityError); it goes once they ended."""
    from datetime import timedelta

    from specq.db.types import utcnow
    from specq.errors import ConfigError
    from specq.jobs.retention import prune, retention_from_env
    from specq.worker.claims import claim_chunk

    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    lines = [{"id": f"r{i}", "prompt": "x", "max_tokens": 2} for i in range(4)]
    job_id = submit_job(env, write_requests(tmp_path / "in.jsonl", lines), "--target", tiny_pair[0])
    db = open_database(pg_db_url)
    with db.session() as session:  # a worker holds them (the claim workers make), and the job expires
        assert len(claim_chunk(session, job_id, 0, 4, "w1", lease_s=600)) == 4
        session.execute(
            update(Job).where(Job.id == job_id).values(state="expired", finished_at=utcnow() - timedelta(days=2))
        )
    assert prune(db, timedelta(days=1)) == (0, 0)
    assert count_rows(pg_db_url, Job) == 1
    with db.session() as session:  # the worker ended them (or its leases ran out)
        session.execute(update(Request).where(Request.job_id == job_id).values(state="expired", lease_owner=None))
    assert prune(db, timedelta(days=1)) == (1, 0)
    assert count_rows(pg_db_url, Job) == 0

    monkeypatch.setenv("SPECQ_RETENTION", "1s")
    with pytest.raises(ConfigError, match="under the floor of 1h"):
        retention_from_env()
    monkeypatch.setenv("SPECQ_RETENTION_BELOW_FLOOR", "1")
    assert retention_from_env() == timedelta(seconds=1)


# -- 5. export of a job deleted while it streams ---------------------------------------------------------
def test_export_fails_when_its_job_is_deleted_while_it_streams(
    pg_db_url, redis_url, tiny_pair, tmp_path, monkeypatch
) -> None:
    """The job is deleted (as `specq delete` does) right after export read its first page: before, it
    wrote the rows it had read and said so, exit 0; now it fails and the file is left as it was."""
    import specq.jobs.export
    from specq.errors import SpecqError
    from specq.jobs.control import delete_job
    from specq.jobs.export import export_job

    monkeypatch.setattr(specq.jobs.export, "PAGE", 10)
    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    lines = [{"id": f"r{i}", "prompt": "x", "max_tokens": 2} for i in range(25)]
    job_id = submit_job(env, write_requests(tmp_path / "in.jsonl", lines), "--target", tiny_pair[0])
    assert invoke(["cancel", job_id], env).exit_code == 0
    db = open_database(pg_db_url)
    reads: list[int] = []

    def deleting_after_the_first_page(read):
        if len(reads) == 2:  # the job, then a page: now it is deleted
            delete_job(db, job_id)
        reads.append(1)
        return read()

    out = tmp_path / "out.jsonl"
    out.write_text("the previous export\n")
    for fmt in ("jsonl", "csv", "openai"):
        reads.clear()
        if not count_rows(pg_db_url, Job):
            job_id = submit_job(env, write_requests(tmp_path / "in.jsonl", lines), "--target", tiny_pair[0])
            assert invoke(["cancel", job_id], env).exit_code == 0
        with pytest.raises(SpecqError, match=f"job {job_id} was deleted while it was exported \\(10 of its 25"):
            export_job(db, job_id, str(out), fmt, patient=cast(Any, deleting_after_the_first_page))
        assert out.read_text() == "the previous export\n"


# -- 6. a partly run `n` line ----------------------------------------------------------------------------
def test_a_partly_run_n_line_exports_its_completed_choices_everywhere_alike(
    pg_db_url, redis_url, tiny_pair, tmp_path
) -> None:
    """A line of n = 4 cancelled after 2 choices: OpenAI output keeps the 2 (indexes 0 and 1) with an
    error saying 2 were cut; it is an error line for every format and filter (before: `not_run
    (completed)`, its completions in no OpenAI file)."""
    import csv

    from specq.decoding.types import GenerationResult
    from specq.worker.claims import claim_chunk
    from specq.worker.results import store_results

    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    lines = [{"id": "many", "prompt": "x", "max_tokens": 2, "n": 4}, {"id": "one", "prompt": "y", "max_tokens": 2}]
    job_id = submit_job(env, write_requests(tmp_path / "in.jsonl", lines), "--target", tiny_pair[0])
    db = open_database(pg_db_url)
    with db.session() as session:  # a worker ran choices 0 and 1 of `many`, then the job was cancelled
        held = claim_chunk(session, job_id, 0, 2, "w1", lease_s=600)
        results = [GenerationResult(c.id, [5, 6], "ab", "length", 1, 2) for c in held]
        store_results(session, job_id, results, "w1")
    assert invoke(["cancel", job_id], env).exit_code == 0

    def export(fmt: str, *only: str) -> list:
        out = tmp_path / f"out.{fmt}"
        result = invoke(["export", job_id, "-o", str(out), "--format", fmt, *only], env)
        assert result.exit_code == 0, result.output
        if fmt == "csv":
            with out.open(newline="", encoding="utf-8") as f:
                return list(csv.DictReader(f))
        return [json.loads(line) for line in out.read_text().splitlines()]

    (many, one) = export("openai")
    assert [c["index"] for c in many["response"]["body"]["choices"]] == [0, 1]
    assert many["response"]["body"]["usage"]["completion_tokens"] == 4
    assert many["error"] == {
        "code": "batch_cancelled",
        "message": "2 of 4 choices did not complete; the first did not run (cancelled)",
    }
    assert one["response"] is None and one["error"]["code"] == "batch_cancelled"
    assert export("openai", "--completed-only") == []
    assert [r["custom_id"] for r in export("openai", "--errors-only")] == ["many", "one"]
    for fmt in ("jsonl", "csv"):  # a row a choice: the 2 completions, and 2 choices that did not run
        rows = export(fmt)
        assert [(r["id"], str(r.get("choice", ""))) for r in rows[:4]] == [("many", str(i)) for i in range(4)]
        assert [r["completion"] or "" for r in rows[:4]] == ["ab", "ab", "", ""]
        assert export(fmt, "--completed-only") == []
        assert len(export(fmt, "--errors-only")) == 5


# -- 7. template size ------------------------------------------------------------------------------------
def test_a_chat_template_is_bounded_in_size_and_read_once(tiny_pair, tmp_path) -> None:
    """/dev/zero is refused at once (before: read for ever, filling the memory); a template over
    256 KiB too. The child may hold 2 GiB, so the old endless read fails instead of swapping."""
    import resource

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    path = write_requests(tmp_path / "in.jsonl", [{"id": "c", **CHAT}])
    big = tmp_path / "big.jinja"
    big.write_text("{# " + "x" * (256 << 10) + " #}{{ messages[0].content }}")
    env = {**os.environ, "SPECQ_HOME": str(tmp_path / "home")}
    for template in ("/dev/zero", str(big)):
        args = ["run", path, "-o", str(tmp_path / "out.jsonl"), "--target", tiny_pair[0], "--chat-template", template]
        done = subprocess.run(
            [sys.executable, "-P", "-m", "specq", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=capped,
        )
        assert done.returncode == 2, done.stderr[-2000:]
        last = done.stderr.strip().splitlines()[-1]
        assert last.endswith(f"--chat-template {template}: larger than 256 KiB (the limit)"), done.stderr


# -- 8. the small ones -----------------------------------------------------------------------------------
def test_a_password_query_in_the_broker_url_is_accepted_or_refused_in_one_line(tmp_path) -> None:
    from specq.errors import ConfigError
    from specq.jobs.services import broker_url

    assert broker_url("redis://h:6379/0?password=s%40cret&db=1") == "redis://:s%40cret@h:6379/0?db=1"
    assert broker_url("redis://user@h/0?password=x") == "redis://user:x@h/0"
    with pytest.raises(ConfigError) as given_twice:
        broker_url("redis://:first@h/0?password=second")
    assert "first" not in str(given_twice.value) and "second" not in str(given_twice.value)
    env = {**os.environ, "SPECQ_HOME": str(tmp_path / "home"), "SPECQ_DATABASE_URL": f"sqlite:///{tmp_path}/s.db"}
    url = "redis://:first@127.0.0.1:1/0?password=second"
    for command in (["worker", "--broker-url", url], ["autoscale", "--max", "1", "--broker-url", url]):
        done = subprocess.run([sys.executable, "-P", "-m", "specq", *command], env=env, capture_output=True, text=True)
        assert done.returncode == 2, done.stderr[-2000:]
        assert "Traceback" not in done.stderr and "first" not in done.stderr and "second" not in done.stderr


def test_metadata_with_control_characters_is_refused(pg_db_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, None, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", [PLAIN])
    for pair in ("note=x\nstate  completed", "note=\x1b[31mred", "k\x07=v"):
        result = invoke(["submit", path, "--target", tiny_pair[0], "--metadata", pair], env)
        assert result.exit_code == 2 and "holds a control character" in result.stderr, result.output
    assert count_rows(pg_db_url, Job) == 0


def test_status_shows_stored_control_characters_escaped_and_json_exact(tmp_path) -> None:
    """A job stored before `--metadata` refused control characters still holds them: `status` writes
    each as its escape, so none reaches the terminal or starts a line, and `--json` keeps them as they are."""
    from specq.db.migrate import open_migrated

    url = f"sqlite:///{tmp_path}/s.db"
    metadata = {"note": "x\nstate      completed", "colour": "\x1b[31mred\x1b[0m", "k\x07\x9b": "v"}
    job = Job(id="j", state="queued", target="t", input_name="in\r.jsonl", settings={}, total=1, user_metadata=metadata)
    with open_migrated(url).session() as session:
        session.add(job)
    env = {**os.environ, "SPECQ_HOME": str(tmp_path / "home"), "SPECQ_DATABASE_URL": url}
    shown = invoke(["status", "j"], env)
    assert shown.exit_code == 0, shown.output
    assert not any(c in shown.stdout for c in "\x1b\x07\x9b\r"), shown.stdout
    (state,) = [line for line in shown.stdout.splitlines() if line.startswith("state")]
    assert state.split() == ["state", "queued"]  # the newline in `note` forged no second state line
    assert "note x\\nstate      completed" in shown.stdout and "colour \\x1b[31mred\\x1b[0m" in shown.stdout
    assert "in\\r.jsonl" in shown.stdout
    exact = json.loads(invoke(["status", "j", "--json"], env).stdout)
    assert exact["metadata"] == metadata and exact["input"] == "in\r.jsonl"


def test_closed_and_full_standard_streams_are_one_line(tiny_pair, tmp_path) -> None:
    env = {**os.environ, "SPECQ_HOME": str(tmp_path / "home"), "SPECQ_DATABASE_URL": f"sqlite:///{tmp_path}/s.db"}
    path = write_requests(tmp_path / "in.jsonl", [PLAIN])
    base = [sys.executable, "-P", "-m", "specq"]
    cases = [  # (args, stdin, stdout, exit code, the error line)
        (["submit", "-"], None, subprocess.PIPE, 2, "<stdin>: standard input is closed"),
        (["run", "-", "-o", str(tmp_path / "o.jsonl")], None, subprocess.PIPE, 2, "<stdin>: standard input is closed"),
        (["run", path, "-o", "-"], subprocess.DEVNULL, None, 2, "cannot write to standard output: it is closed"),
        (["run", path, "-o", "-"], subprocess.DEVNULL, "/dev/full", 1, "cannot write standard output: No space left"),
    ]
    for args, stdin, stdout, code, error in cases:
        out: Any = open(stdout, "w") if stdout == "/dev/full" else stdout  # noqa: SIM115
        done = subprocess.run(
            [*base, *args, "--target", tiny_pair[0]],
            env=env,
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            close_fds=True,
            stdin=stdin,
            preexec_fn=_closing(0 if stdin is None else 1 if stdout is None else None),
        )
        if stdout == "/dev/full":
            out.close()
        assert done.returncode == code, done.stderr[-2000:]
        assert "Traceback" not in done.stderr and error in done.stderr, done.stderr[-2000:]


def _closing(fd):
    """A preexec_fn that closes `fd` in the child (None: nothing), as `<&-` and `>&-` do."""

    def close() -> None:
        if fd is not None:
            os.close(fd)

    return close


def test_odd_values_are_one_line(pg_db_url, redis_url, tiny_pair, tmp_path) -> None:
    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", [PLAIN])
    odd_path = tmp_path / os.fsdecode(b"\xff.jsonl")
    odd_path.write_text(json.dumps(PLAIN) + "\n")
    assert submit_job(env, str(odd_path), "--target", tiny_pair[0])  # stored under a printable name
    for args, error in (
        (["submit", path, "--served-model-name", os.fsdecode(b"\xff")], "--served-model-name must be printable"),
        (["submit", path, "--completion-window", "1.00000000000000000h"], "is longer than 16 characters"),
        (["status", "--limit", str(2**63)], "--limit"),
    ):
        result = invoke([*args, "--target", tiny_pair[0]] if args[0] == "submit" else args, env)
        assert result.exit_code == 2 and error in result.stderr, result.output


def test_worker_metrics_report_the_served_model_name() -> None:
    from specq.db.models import Job as JobRow
    from specq.worker.chunk import _Writer

    job = JobRow(id="j", target="/some/folder/target", settings={}, served_model_name="svc", created_at=None)
    assert _Writer(None, job).model == "svc"  # type: ignore[arg-type]
    assert _Writer(None, JobRow(id="j", target="/some/folder/target", settings={})).model == "target"  # type: ignore[arg-type]


def test_a_worker_on_another_database_gives_the_chunk_back(pg_db_url, redis_url, tiny_pair, tmp_path) -> None:
    """A worker pointed at the wrong database (it holds no such job) sets the chunk aside saying why and
    keeps serving (issue 49: it used to give it back and exit 4, and so did every next worker); before
    that, it acknowledged and dropped it as a deleted job's. The right worker then runs it: its sweeper
    finds the job's queued requests with no message, and enqueues the chunk again."""
    import redis

    from specq.db.migrate import open_migrated
    from specq.queue import CHUNK_QUEUE_KEY, DEAD_LETTER_KEY
    from tests.services import SpecqWorker, create_database, drop_database

    other_name = f"specq_test_other_{os.getpid()}"
    other_url = create_database(other_name)
    try:
        open_migrated(other_url)
        env = services_env(pg_db_url, redis_url, tmp_path / "home", **DRILL_ENV)
        job_id = submit_job(env, write_requests(tmp_path / "in.jsonl", [PLAIN]), "--target", tiny_pair[0])
        wrong = SpecqWorker({**env, "SPECQ_DATABASE_URL": other_url}, tmp_path / "wrong.log")
        try:
            wait_for(lambda: f"job {job_id} chunk [0, 1) is in database " in wrong.output(), 120, "the set-aside")
            assert wrong.proc.poll() is None, wrong.output()  # still serving
        finally:
            assert wrong.stop() == 0, wrong.output()
        client = redis.Redis.from_url(redis_url)
        assert (client.llen(DEAD_LETTER_KEY), client.llen(CHUNK_QUEUE_KEY)) == (1, 0)  # set aside, not given back
        right = SpecqWorker(env, tmp_path / "right.log")
        try:
            info = wait_state(env, job_id, {"completed", "failed", "cancelled"}, timeout=120)
        finally:
            right.stop()
        assert (info["state"], info["completed"]) == ("completed", 1), info
    finally:
        drop_database(other_name)


def test_a_rejected_submit_leaves_no_dead_rows(pg_db_url, tiny_pair, tmp_path) -> None:
    """20,000 good lines then a bad one: rejected, and the rows its COPY wrote are vacuumed away (the
    table's size is what it was), not left for autovacuum (50 MB for 200,000 lines)."""
    from sqlalchemy import text

    db = open_database(pg_db_url)

    def size() -> int:
        with db.engine.connect() as conn:
            return int(conn.execute(text("SELECT pg_relation_size('requests')")).scalar_one())

    before = size()
    lines = [{"id": str(i), "prompt": "x" * 100} for i in range(20_000)] + ['{"prompt": ""}']
    path = write_requests(tmp_path / "in.jsonl", lines)
    result = invoke(["submit", path, "--target", tiny_pair[0]], services_env(pg_db_url, None, tmp_path / "home"))
    assert result.exit_code == 2, result.output
    assert count_rows(pg_db_url, Request) == 0
    assert size() == before
