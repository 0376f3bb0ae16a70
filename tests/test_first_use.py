"""What a newcomer meets first (issue 35, items 4 and 6), through the commands on the real services:

- `specq db upgrade` creates a PostgreSQL database that does not exist yet (a fresh server has only
  `postgres`), where the URL's user may;
- a database that refuses for good (no such database, an unknown user) is one line at once, while an
  unreachable server is still waited for (jobs.patience);
- a mistyped model folder is named as missing, not answered with hub advice about repo ids;
- a missing --target says where one comes from;
- `-k 0` with a draft model decodes with the target alone, as the option's range (0-32) promises.
"""

from __future__ import annotations

import json
import os
import uuid

from tests.services import database_url, drop_database, invoke, services_env, write_requests

LINES = [{"id": "a", "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0}]


def _unique_database() -> str:
    return f"specq_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def test_db_upgrade_creates_a_missing_postgres_database(tmp_path) -> None:
    name = _unique_database()  # never created by anyone else: a fresh name per run
    url = database_url(name)
    env = services_env(url, None, tmp_path / "home")
    try:
        result = invoke(["db", "upgrade"], env)
        assert result.exit_code == 0, result.output
        assert f"created the database {name}" in result.stderr
        assert "schema migrated from empty to" in result.stderr
        again = invoke(["db", "upgrade"], env)
        assert again.exit_code == 0, again.output
        assert "created" not in again.stderr and "schema already at revision" in again.stderr
        listed = invoke(["status", "--json"], env)
        assert listed.exit_code == 0, listed.output
        assert json.loads(listed.stdout) == []
    finally:
        drop_database(name)


def test_a_database_that_refuses_is_one_line_at_once(tmp_path) -> None:
    # patience of 3 s: the old code waited it out with a warning line; the verdict is on the lines alone
    missing = services_env(database_url(_unique_database()), None, tmp_path / "home", SPECQ_OUTAGE_PATIENCE_S="3")
    result = invoke(["status"], missing)
    assert result.exit_code == 1, result.output
    assert "has no database" in result.stderr and "`specq db upgrade` creates it" in result.stderr
    assert "unreachable" not in result.stderr and "trying again" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr

    stranger = f"postgresql+psycopg://nobody_{uuid.uuid4().hex[:8]}:secret@127.0.0.1:5432/postgres"
    refused = invoke(["workers"], services_env(stranger, None, tmp_path / "home", SPECQ_OUTAGE_PATIENCE_S="3"))
    assert refused.exit_code == 1, refused.output
    assert "refused the connection" in refused.stderr and "does not exist" in refused.stderr
    assert "trying again" not in refused.stderr and "secret" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr


def test_an_unreachable_database_is_still_waited_for(tmp_path) -> None:
    # port 1: nothing listens there, so the connection is refused by the host, not by a database server
    env = services_env("postgresql+psycopg://postgres@127.0.0.1:1/specq", None, tmp_path / "home")
    env["SPECQ_OUTAGE_PATIENCE_S"] = "0.5"
    result = invoke(["status"], env)
    assert result.exit_code == 1, result.output
    assert "unreachable" in result.stderr and "trying again" in result.stderr


def test_a_missing_model_folder_is_named_as_missing(tiny_pair, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES)
    env = services_env(f"sqlite:///{tmp_path / 'specq.db'}", None, tmp_path / "home")
    out = str(tmp_path / "out.jsonl")
    for command, missing in (
        (["run", path, "-o", out, "--target", "./no/such/model"], "./no/such/model"),
        (["run", path, "-o", out, "--target", tiny_pair[0], "--draft", "models/no/draft"], "models/no/draft"),
        (["submit", path, "--target", "./no/such/model"], "./no/such/model"),
    ):
        result = invoke(command, env)
        assert result.exit_code == 2, result.output
        assert f"no folder exists at '{missing}', and it is not a Hugging Face id" in result.stderr, result.stderr
        assert "Repo id" not in result.stderr


def test_a_missing_target_says_where_one_comes_from(tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES)
    env = services_env(f"sqlite:///{tmp_path / 'specq.db'}", None, tmp_path / "home")
    for command in (["run", path], ["submit", path]):
        result = invoke(command, env)
        assert result.exit_code == 2, result.output
        assert "Missing option '--target'" in result.stderr
        assert "SPECQ_TARGET" in result.stderr and "specq demo-models" in result.stderr


def test_k_0_with_a_draft_decodes_with_the_target_alone(tiny_pair, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", LINES)
    env = services_env(f"sqlite:///{tmp_path / 'specq.db'}", None, tmp_path / "home")
    alone, with_draft = tmp_path / "alone.jsonl", tmp_path / "k0.jsonl"
    result = invoke(["run", path, "-o", str(alone), "--target", tiny_pair[0]], env)
    assert result.exit_code == 0, result.output
    result = invoke(
        ["run", path, "-o", str(with_draft), "--target", tiny_pair[0], "--draft", tiny_pair[1], "-k", "0"], env
    )
    assert result.exit_code == 0, result.output
    tokens = [json.loads(line)["tokens"] for line in alone.read_text().splitlines()]
    k0 = [json.loads(line) for line in with_draft.read_text().splitlines()]
    assert [line["tokens"] for line in k0] == tokens
    assert [line["draft_tokens"] for line in k0] == [0]
    assert "acceptance n/a" in result.stderr


def test_k_0_engine_runs_no_proposer(target, draft) -> None:
    import torch

    from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
    from tests.tiny_models import IdTokenizer

    prompts = [torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 7, 11)]
    requests = [
        GenerationRequest(i, tuple(p), SamplingParams(max_tokens=12, temperature=0.0)) for i, p in enumerate(prompts)
    ]
    alone = SpeculativeEngine(target, IdTokenizer(), None, DecodingConfig(strict=True))
    expected = {r.key: r.token_ids for r in alone.generate(requests)}
    for model_free in (None, "ngram"):
        config = DecodingConfig(num_speculative_tokens=0, model_free=model_free, strict=True)
        engine = SpeculativeEngine(target, IdTokenizer(), draft, config)
        assert {r.key: r.token_ids for r in engine.generate(requests)} == expected
        assert engine.proposer is None and engine.max_k == 0 and engine.stats.num_draft_tokens == 0
