"""Output where users look (issue 51, item 6): a plain progress log ends on the final count; target-only
work has no acceptance rate (`n/a` in text, null in `status --json`), in `draft train` too; a time budget
reads "training for 120s"; `--compile auto` that compiled nothing says nothing; GGUF conversion draws no
tqdm bar; a worker run as root is told once, in one line, and Celery's seven are silenced; `specq
workers` says `loading MODEL` for a worker loading its job's models. Clocks are injected: no verdict
depends on the machine's speed."""

from __future__ import annotations

import io
import json
import logging
import warnings
from dataclasses import fields

import pytest

from specq.budget import Budget
from specq.cli.progress import ProgressBar
from specq.db.migrate import open_migrated
from specq.db.models import Job, Worker
from specq.db.states import WorkerState
from specq.db.types import utcnow
from specq.decoding.compiled import CompileOutcome
from specq.decoding.stats import EngineStats
from specq.jobs.status import JobStatus, ProposerAcceptance, TokenUsage
from specq.models.loading import ModelPair
from tests.services import invoke, services_env


# -- progress ------------------------------------------------------------------------------------------
def test_a_plain_progress_log_ends_on_the_final_count(capsys) -> None:
    """A run shorter than a period between lines still ends on its final count, once."""
    bar = ProgressBar("decode", 27, show=True, clock=lambda: 0.0).__enter__()
    assert bar.plain  # pytest's captured stderr is no terminal
    bar.update(17, 10.0, None)
    bar.update(27, 12.0, None)
    bar.__exit__()
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["decode: 27/27 done, 0 failed, 12.0 tok/s, acceptance n/a"]


def test_a_final_count_already_printed_is_not_printed_again(capsys) -> None:
    now = iter([0.0, 100.0])  # the bar's start, then the one update, a period later: printed then
    bar = ProgressBar("decode", 2, show=True, clock=lambda: next(now)).__enter__()
    bar.update(2, 5.0, 0.5)
    bar.__exit__()
    assert capsys.readouterr().err.splitlines() == ["decode: 2/2 done, 0 failed, 5.0 tok/s, acceptance 0.50"]


def test_draft_trains_target_decode_has_no_acceptance_rate(capsys) -> None:
    """The target decodes alone there: n/a, as `run` says it, not `acceptance 0.00`."""
    from specq.cli.draft import _Shown
    from specq.speaking import Speaker

    shown = _Shown(show=True, speaker=Speaker(lambda line: None))
    shown.decoding(3, 3, EngineStats(num_generated_tokens=30))
    err = capsys.readouterr().err
    assert "target decodes: 3/3 done" in err and "acceptance n/a" in err and "0.00" not in err


def test_a_time_budget_is_said_once() -> None:
    line = f"training for {Budget.parse('120s').describe()}"
    assert line == "training for 120s"
    assert Budget.parse("200k").describe() == "200000 tokens"


# -- status --json --------------------------------------------------------------------------------------
def _status(**given: object) -> JobStatus:
    """A JobStatus of zeros and empties but for `given`."""
    empty = {"int": 0, "float": 0.0, "str": "x", "list[float]": [], "TokenUsage": TokenUsage(0, 0, 0)}
    values = {f.name: None if "None" in str(f.type) else empty.get(str(f.type), {}) for f in fields(JobStatus)}
    return JobStatus(**{**values, **given})  # type: ignore[arg-type]


def test_status_json_says_null_where_nothing_was_proposed() -> None:
    idle = ProposerAcceptance(drafts=0, draft_tokens=0, accepted_tokens=0, acceptance_rate=0.0)
    shown = _status(acceptance_by_proposer={"ngram": idle}).to_json()
    assert shown["acceptance_rate"] is None and shown["mean_acceptance_length"] is None
    assert shown["acceptance_by_proposer"]["ngram"]["acceptance_rate"] is None


def test_status_json_keeps_a_rate_where_drafts_were_proposed() -> None:
    ran = ProposerAcceptance(drafts=3, draft_tokens=12, accepted_tokens=9, acceptance_rate=0.75)
    shown = _status(
        num_drafts=3,
        num_draft_tokens=12,
        acceptance_rate=0.75,
        mean_acceptance_length=4.0,
        acceptance_by_proposer={"ngram": ran},
    ).to_json()
    assert shown["acceptance_rate"] == 0.75 and shown["mean_acceptance_length"] == 4.0
    assert shown["acceptance_by_proposer"]["ngram"]["acceptance_rate"] == 0.75


# -- --compile ------------------------------------------------------------------------------------------
def _pair(mode: str, outcome: CompileOutcome) -> ModelPair:
    return ModelPair(None, None, None, "t", None, compiled={"target": outcome}, compile_mode=mode)  # type: ignore[arg-type]


def test_compile_auto_that_compiled_nothing_says_nothing() -> None:
    eager = CompileOutcome(False, reason="--compile auto on cpu: not measured on this machine yet")
    assert _pair("auto", eager).compile_line() is None


def test_compile_asked_for_says_what_it_did() -> None:
    eager = CompileOutcome(False, reason="--compile on: the model cannot be captured")
    assert _pair("on", eager).compile_line() == "--compile: target: eager (--compile on: the model cannot be captured)"
    compiled = CompileOutcome(True, seconds=2.0, graphs=3)
    assert (_pair("auto", compiled).compile_line() or "").startswith("--compile: target: compiled")


# -- the GGUF conversion's bar -------------------------------------------------------------------------
def test_the_gguf_readers_own_bar_is_silenced_and_restored() -> None:
    pytest.importorskip("gguf")
    from transformers import modeling_gguf_pytorch_utils as reader

    from specq.models.gguf import _quiet_tensor_bar

    drawn = reader.tqdm
    stream = io.StringIO()
    with _quiet_tensor_bar():
        for _ in reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...", file=stream):
            pass
    assert stream.getvalue() == ""
    assert reader.tqdm is drawn


# -- the worker as root -----------------------------------------------------------------------------------
def test_a_worker_run_as_root_is_told_once_in_one_line(caplog) -> None:
    from celery.exceptions import SecurityWarning

    from specq.worker.main import say_once_if_root

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with caplog.at_level(logging.WARNING, logger="specq.worker.main"):
            assert say_once_if_root(euid=0)
        warnings.warn(SecurityWarning("You're running the worker with superuser privileges..."), stacklevel=1)
    assert not caught  # Celery's own seven lines silenced
    said = [r.getMessage() for r in caplog.records]
    assert said == ["the worker runs as root; it needs no privileges (run it as another user)"]


def test_a_worker_not_run_as_root_is_told_nothing(caplog) -> None:
    from specq.worker.main import say_once_if_root

    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="specq.worker.main"):
        assert not say_once_if_root(euid=1000)
    assert not caplog.records


# -- a worker loading its models -----------------------------------------------------------------------
def test_workers_says_loading_model_for_a_worker_loading_its_jobs_models(sqlite_url, tmp_path) -> None:
    db = open_migrated(sqlite_url)
    now = utcnow()
    with db.session() as session:
        session.add(Job(id="j1", state="running", target="smollm2-135m-instruct", input_name="i", settings={}))
        session.flush()
        for name, state, job in (("w-load", WorkerState.LOADING, "j1"), ("w-idle", WorkerState.IDLE, None)):
            session.add(
                Worker(
                    name=name,
                    device="cpu",
                    state=state,
                    host="h",
                    pid=1,
                    started_at=now,
                    heartbeat_at=now,
                    current_job=job,
                )
            )
    env = services_env(sqlite_url, None, tmp_path / "home")
    result = invoke(["workers"], env)
    assert result.exit_code == 0, result.output
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert "loading smollm2-135m-instruct" in rows["w-load"], result.stdout
    assert "idle" in rows["w-idle"] and "loading" not in rows["w-idle"]
    result = invoke(["workers", "--json"], env)
    listed = {w["name"]: w for w in json.loads(result.stdout)}
    assert listed["w-load"]["state"] == "loading" and listed["w-load"]["loading"] == "smollm2-135m-instruct"
    assert listed["w-idle"]["loading"] is None


def test_the_model_cache_says_when_it_loads_and_not_when_it_holds(tmp_path) -> None:
    from specq.worker.model_cache import ModelCache
    from tests.tiny_models import save_tiny_pair

    target, _ = save_tiny_pair(tmp_path)
    cache = ModelCache(1, "off")
    loads: list[str] = []
    cache.get(target, None, None, "cpu", "off", on_load=lambda: loads.append("loading"))
    cache.get(target, None, None, "cpu", "off", on_load=lambda: loads.append("loading"))
    assert loads == ["loading"]
