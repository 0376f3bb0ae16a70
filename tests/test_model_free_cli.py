"""`--draft ngram`, `--draft suffix` and `--draft MODEL --model-free ngram|suffix` through the CLI and the
queue: the same seeded tokens as the target alone, usage errors for unknown proposers, and the
acceptance split by proposer in `specq status --json`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specq.decoding.suffix_index import SuffixIndex
from specq.worker.context import MAX_SUFFIX_INDEXES, WorkerContext
from tests.services import invoke, job_status, services_env, submit_job, wait_state, write_requests

# Prompts that repeat themselves, so that prompt lookup finds matches to propose from.
LINES = [
    {
        "id": f"r{i}",
        "prompt": "def add(a, b):\n    return a + b\n\ndef mul(a, b):\n    return a * b\n\ndef add(a, b):\n",
        # long enough for the tiny target's greedy rows to repeat themselves, which prompt lookup then
        # offers: the hybrid's first lookups must be found, not be the luck of a step or two
        "max_tokens": 24 + i,
        "temperature": t,
        "seed": 7 + i,
    }
    for i, t in enumerate([0.0, 1.0, 0.8, 0.0])
]


def _tokens(path: Path) -> dict[str, list[int]]:
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert all(r["error"] is None for r in records), records
    return {r["id"]: r["tokens"] for r in records}


def test_run_with_each_proposer_gives_the_target_alones_tokens(tiny_pair, tmp_path):
    env = {"SPECQ_HOME": str(tmp_path / "home")}
    path = write_requests(tmp_path / "in.jsonl", LINES)

    def run(out: str, *args: str) -> dict[str, list[int]]:
        result = invoke(["run", path, "-o", str(tmp_path / out), "--target", tiny_pair[0], *args], env)
        assert result.exit_code == 0, result.output
        return _tokens(tmp_path / out)

    expected = run("alone.jsonl", "--batch-size", "1")
    proposers = [
        ("--draft", "ngram"),
        ("--draft", "suffix", "--batch-size", "2"),
        ("--draft", tiny_pair[1], "--model-free", "suffix", "--batch-size", "3"),
        ("--model-free", "ngram", "-k", "2", "--fixed-k"),
    ]
    for n, args in enumerate(proposers):
        assert run(f"out{n}.jsonl", *args) == expected, args
    records = [json.loads(line) for line in (tmp_path / "out0.jsonl").read_text().splitlines()]
    assert sum(r["draft_tokens"] for r in records) > 0  # prompt lookup did propose


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--draft", "ngrams"), "ngram, suffix"),
        (("--draft", "sufix"), "ngram, suffix"),
        (("--draft", "ngram", "--model-free", "suffix"), "--model-free"),
        (("--model-free", "lookup"), "'ngram', 'suffix'"),
    ],
)
@pytest.mark.parametrize("command", ["run", "submit"])
def test_an_unknown_proposer_is_a_usage_error_naming_the_choices(tiny_pair, tmp_path, command, args, says):
    path = write_requests(tmp_path / "in.jsonl", LINES[:1])
    argv = [command, path, "--target", tiny_pair[0], *args]
    if command == "run":
        argv += ["-o", str(tmp_path / "out.jsonl")]
    result = invoke(argv, {"SPECQ_HOME": str(tmp_path / "home")})
    assert result.exit_code == 2, result.output
    assert says in result.output
    assert not (tmp_path / "out.jsonl").exists()


def test_a_worker_keeps_one_bounded_suffix_index_per_job():
    ctx = WorkerContext(None, "w", "cpu")  # type: ignore[arg-type]  # no database needed here
    first = ctx.suffix_index("job-a")
    assert isinstance(first, SuffixIndex) and ctx.suffix_index("job-a") is first
    for n in range(MAX_SUFFIX_INDEXES):
        ctx.suffix_index(f"job-{n}")
    assert "job-a" not in ctx.suffix_indexes and len(ctx.suffix_indexes) == MAX_SUFFIX_INDEXES


def test_status_splits_acceptance_by_proposer(pg_db_url, redis_url, tiny_pair, tmp_path, start_worker):
    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    path = write_requests(tmp_path / "in.jsonl", LINES)
    worker = start_worker(env)

    def split_of(*args: str) -> dict[str, dict[str, int]]:
        job_id = submit_job(env, path, "--target", tiny_pair[0], *args)
        info = wait_state(env, job_id, {"completed", "failed", "cancelled"})
        assert info["state"] == "completed", info
        split = info["acceptance_by_proposer"]
        assert set(split) == {"draft", "ngram", "suffix"}
        assert sum(c["draft_tokens"] for c in split.values()) == info["num_draft_tokens"] > 0
        assert sum(c["accepted_tokens"] for c in split.values()) == info["num_accepted_tokens"]
        assert job_status(env, job_id)["acceptance_by_proposer"] == split
        return split

    # Which proposer a hybrid's rows take follows the step times the worker measures (tested in-process
    # with modelled times: tests/test_model_free.py), so here only its sums are the verdict ...
    split_of("--draft", tiny_pair[1], "--model-free", "suffix")
    # ... and the split is shown by proposers that offer whenever they match: lookups alone at a fixed k
    split = split_of("--draft", "suffix", "--fixed-k")
    assert split["draft"]["draft_tokens"] == 0 and split["ngram"]["draft_tokens"] > 0
    assert worker.stop() == 0, worker.output()
