"""Shared test fixtures."""


# ==== demo model fixtures (models/ tests) ===============================================================
# The real demo draft/target pair, built once per machine into specq's data directory (a few CPU minutes
# the first time, then read from the cache). Session-scoped fixtures are set up before the function-scoped
# `_specq_isolated_env`, so the build lands in the user's data dir (or $SPECQ_HOME), not a test tmp dir.

import pytest as _pytest_demo


@_pytest_demo.fixture(scope="session")
def demo_pair():
    """models.demo.DemoModels: target_dir, draft_dir and the build's report."""
    from models.demo import build_demo_models

    return build_demo_models()


# ==== end of demo model fixtures ========================================================================


# ==== storage and queue fixtures (jobs/, db/, worker/ tests) ===========================================
# Real services: a throwaway PostgreSQL database per test session (specq_test_<pid>, dropped at the end),
# Redis database 15 flushed around each test, real `specq worker` subprocesses. Nothing is mocked.

import json as _json  # noqa: E402  (this section's imports)
import os as _os  # noqa: E402  (this section's imports)
import signal as _signal  # noqa: E402  (this section's imports)
import subprocess as _subprocess  # noqa: E402  (this section's imports)
import sys as _sys  # noqa: E402  (this section's imports)
import time as _time  # noqa: E402  (this section's imports)
from pathlib import Path as _Path  # noqa: E402  (this section's imports)

import pytest as _pytest  # noqa: E402  (this section's imports)

PG_ADMIN_URL = _os.environ.get("SPECQ_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_TEST_URL = _os.environ.get("SPECQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
_TABLES = ("results", "batches", "requests", "workers", "jobs")

_TINY_CORPUS = (
    "def add(a, b):\n    return a + b\n\n"
    "def mul(a, b):\n    return a * b\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "for i in range(10):\n    print(i, 'hello, world')\n"
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.\n"
) * 4


@_pytest.fixture(autouse=True)
def _specq_isolated_env(tmp_path_factory, monkeypatch):
    """No test sees the user's data directory or service URLs."""
    monkeypatch.setenv("SPECQ_HOME", str(tmp_path_factory.mktemp("specq_home")))
    for name in ("SPECQ_DATABASE_URL", "SPECQ_BROKER_URL", "SPECQ_TARGET", "SPECQ_DRAFT"):
        monkeypatch.delenv(name, raising=False)


@_pytest.fixture(scope="session")
def pg_url():
    """A PostgreSQL database for this test session; skipped when no server answers."""
    import psycopg

    name = f"specq_test_{_os.getpid()}"
    try:
        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        _pytest.skip(f"no PostgreSQL at {PG_ADMIN_URL}: {exc}")
    with admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    yield f"{base}/{name}"
    from db.session import dispose_all

    dispose_all()
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@_pytest.fixture
def pg_db_url(pg_url):
    """The session's PostgreSQL database, migrated and emptied for this test."""
    from sqlalchemy import text

    from db.session import open_database

    db = open_database(pg_url)
    with db.engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {', '.join(_TABLES)} RESTART IDENTITY CASCADE"))
    return pg_url


@_pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'specq.db'}"


@_pytest.fixture(params=["sqlite", "postgresql"])
def any_db_url(request, tmp_path):
    """Each test using it runs on both stores."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'specq.db'}"
    return request.getfixturevalue("pg_db_url")


@_pytest.fixture
def redis_url():
    """Redis database 15, flushed before and after the test; skipped when no server answers."""
    import redis

    client = redis.Redis.from_url(REDIS_TEST_URL, socket_connect_timeout=3)
    try:
        client.flushdb()
    except redis.RedisError as exc:
        _pytest.skip(f"no Redis at {REDIS_TEST_URL}: {exc}")
    yield REDIS_TEST_URL
    client.flushdb()
    client.close()


@_pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, draft_dir): a byte-level BPE tokenizer with a chat template and two tiny random
    Llamas (the draft a noisy copy of the target) saved as `from_pretrained` folders; builds in seconds."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_models import noisy_copy, tiny_llama

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],  # ids 0 and 1: tiny_llama's BOS and EOS
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TINY_CORPUS], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<s>")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    )
    target = tiny_llama(vocab=len(tokenizer), layers=2, hidden=64, seed=0, max_positions=256)
    draft = noisy_copy(target, scale=0.02, seed=1)
    root = tmp_path_factory.mktemp("tiny_pair")
    dirs = []
    for name, model in (("target", target), ("draft", draft)):
        model.to(torch.float32).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs.append(str(root / name))
    return dirs[0], dirs[1]


def write_requests(path, lines):
    """Write JSONL: dicts are JSON-encoded, strings written as they are."""
    with open(path, "w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else _json.dumps(line)) + "\n")
    return str(path)


class SpecqWorker:
    """A real `specq worker` subprocess, logging to a file."""

    def __init__(self, env, log_path, device="cpu", metrics_port=None):
        args = [_sys.executable, "-c", "from cli.main import main; main()", "worker", "--device", device]
        if metrics_port is not None:
            args += ["--metrics-port", str(metrics_port)]
        self.log_path = _Path(log_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = _subprocess.Popen(args, env=env, stdout=self._log, stderr=_subprocess.STDOUT)

    def output(self):
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout=60.0):
        deadline = _time.monotonic() + timeout
        while _time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.output()}")
            if " ready." in self.output():
                return self
            _time.sleep(0.2)
        raise RuntimeError(f"worker not ready after {timeout}s:\n{self.output()}")

    def stop(self, sig=_signal.SIGTERM, timeout=60.0):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except _subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@_pytest.fixture
def start_worker(tmp_path):
    """Factory: start_worker(env) -> a ready SpecqWorker; all are stopped (SIGTERM) after the test."""
    started = []

    def start(env, **kwargs):
        worker = SpecqWorker(env, tmp_path / f"worker{len(started)}.log", **kwargs)
        started.append(worker)
        return worker.wait_ready()

    yield start
    for worker in started:
        worker.stop()


def services_env(db_url, broker, home, **extra):
    """The environment of a CLI call or worker process: these services, no other SPECQ_ setting."""
    env = {k: v for k, v in _os.environ.items() if not k.startswith("SPECQ_")}
    env.update(SPECQ_DATABASE_URL=db_url, SPECQ_HOME=str(home), OMP_NUM_THREADS="1", **extra)
    if broker:
        env["SPECQ_BROKER_URL"] = broker
    return env


def invoke(args, env=None):
    """`specq ARGS` in-process (click's CliRunner); stdout and stderr apart in .stdout / .stderr."""
    from click.testing import CliRunner

    from cli.main import _register, cli

    _register()
    return CliRunner().invoke(cli, args, env=env, catch_exceptions=False)


def count_rows(db_url, model):
    from sqlalchemy import func, select

    from db.session import open_database

    with open_database(db_url).session() as session:
        return session.scalar(select(func.count()).select_from(model)) or 0


def job_status(env, job_id):
    result = invoke(["status", job_id, "--json"], env)
    assert result.exit_code == 0, result.output
    return _json.loads(result.stdout)


def wait_state(env, job_id, states, timeout=90.0):
    """Poll `specq status` until the job is in one of `states`; its status."""
    deadline = _time.monotonic() + timeout
    while True:
        info = job_status(env, job_id)
        if info["state"] in states:
            return info
        if _time.monotonic() > deadline:
            raise AssertionError(f"job {job_id} still {info['state']} after {timeout}s")
        _time.sleep(0.3)


def reference_greedy(target_dir, lines):
    """{id: token ids} of the greedy lines, from the engine run directly on the target alone, one
    request at a time: what any batching, any draft and any worker must reproduce exactly."""
    from decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
    from models.loading import load_pair, tokenize_prompt

    pair = load_pair(target_dir, None, "cpu", None)
    engine = SpeculativeEngine(pair.target, pair.tokenizer, None, DecodingConfig(batch_size=1))
    out = {}
    for number, line in enumerate(lines, start=1):
        body = line.get("body", line)
        if body.get("temperature") != 0:
            continue
        ids = tokenize_prompt(pair.tokenizer, prompt=body.get("prompt"), messages=body.get("messages"))
        params = SamplingParams(max_tokens=body["max_tokens"], temperature=0.0)
        (result,) = engine.generate([GenerationRequest(0, tuple(ids), params)])
        out[str(line.get("id") or line.get("custom_id") or number)] = result.token_ids
    return out


# ==== end of storage and queue fixtures =================================================================
