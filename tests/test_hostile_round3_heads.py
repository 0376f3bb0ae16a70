"""Hostile round 3 (issue 49), draft heads: items 1 and 6.

1. `specq draft train` writes a head folder and says to pass it to `--draft`: `submit` (embedded and
   with services) and the workers take it as `run` does, by one rule (models/loading.py check_pair);
   the README's flow `draft train` -> `submit --draft DIR --wait` -> `export` runs end to end through
   a real worker, its greedy completions the target's own.
2. A head folder is checked field by field before anything is read or built (decoding/draft_head.py
   read_head): types, ranges, the target's shape, the sizes the config implies against the weight
   file, vocabulary ids in [0, target vocab); a bad one is refused in one line, exit 2, by `run`,
   `submit` and a load alike, never a traceback at the first proposal or gigabytes allocated first.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from specq.decoding.draft_head import HEAD_CONFIG, HEAD_WEIGHTS
from specq.errors import ModelLoadError
from specq.models.loading import load_pair
from tests.services import invoke, job_status, reference_greedy, services_env, write_requests
from tests.test_distill import _prompt_lines

LINES = [
    {"id": f"q{i}", "prompt": f"def f{i}(x): return x * {i} +", "max_tokens": 8, "temperature": 0} for i in range(4)
]
# the smallest run `draft train` takes: a few completions, a few hundred chain steps, a quick measure
TRAIN_FAST = ["--max-tokens", "8", "--budget", "2k", "--eval-warmup", "0", "--no-progress", "--proposer", "head"]


@pytest.fixture(scope="module")
def head_dir(tiny_pair, tmp_path_factory) -> Path:
    """The folder `specq draft train` writes for the tiny target, as the README's first step."""
    root = tmp_path_factory.mktemp("round3-head")
    data = write_requests(root / "prompts.jsonl", _prompt_lines(8))
    result = invoke(
        ["draft", "train", "--target", tiny_pair[0], "--data", data, "-o", str(root / "my-draft"), *TRAIN_FAST]
    )
    assert result.exit_code == 0, result.output
    assert f"--draft {root / 'my-draft'}" in result.stderr  # what the command tells the user to pass
    return root / "my-draft"


def _exported(env: dict[str, str], job_id: str, out: Path) -> dict[str, list[int]]:
    result = invoke(["export", job_id, "-o", str(out)], env)
    assert result.exit_code == 0, result.output
    return {r["id"]: r["tokens"] for r in map(json.loads, out.read_text(encoding="utf-8").splitlines())}


# -- 1. the folder `draft train` writes is a draft every command takes --------------------------------------
def test_the_readme_flow_trains_submits_to_a_worker_and_exports_the_targets_own_completions(
    tiny_pair, head_dir, pg_db_url, redis_url, start_worker, tmp_path
):
    env = services_env(pg_db_url, redis_url, tmp_path / "home")
    start_worker(env).wait_ready()
    path = write_requests(tmp_path / "prompts.jsonl", LINES)
    args = ["submit", path, "--target", tiny_pair[0], "--draft", str(head_dir), "--fixed-k", "--wait"]
    result = invoke(args, env)
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip()
    info = job_status(env, job_id)
    assert (info["state"], info["completed"]) == ("completed", len(LINES))
    assert info["num_draft_tokens"] > 0  # the worker loaded the head and it drafted
    assert _exported(env, job_id, tmp_path / "out.jsonl") == reference_greedy(tiny_pair[0], LINES)


def test_an_embedded_submit_takes_the_head_folder_too(tiny_pair, head_dir, tmp_path, sqlite_url):
    env = {"SPECQ_HOME": str(tmp_path / "home"), "SPECQ_DATABASE_URL": sqlite_url}
    path = write_requests(tmp_path / "prompts.jsonl", LINES[:2])
    result = invoke(["submit", path, "--target", tiny_pair[0], "--draft", str(head_dir), "--fixed-k", "--wait"], env)
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip()
    assert job_status(env, job_id)["num_draft_tokens"] > 0
    assert _exported(env, job_id, tmp_path / "out.jsonl") == reference_greedy(tiny_pair[0], LINES[:2])


# -- 6. every field of a head checked before anything is built ----------------------------------------------
def _edit_config(**changes: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        config = json.loads((folder / HEAD_CONFIG).read_text())
        config.update(changes)
        (folder / HEAD_CONFIG).write_text(json.dumps(config))

    return edit


def _edit_weights(change: Callable[[dict[str, torch.Tensor]], Any]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        weights = torch.load(folder / HEAD_WEIGHTS, weights_only=True)
        weights = change(weights) or weights
        torch.save(weights, folder / HEAD_WEIGHTS)

    return edit


def _set_id(position: int, value: int) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(weights: dict[str, torch.Tensor]) -> None:
        weights["vocab_ids"][position] = value

    return change


def _halve_gate(weights: dict[str, torch.Tensor]) -> None:
    weights["gate.weight"] = weights["gate.weight"][: weights["gate.weight"].shape[0] // 2].clone()


def _poison(weights: dict[str, torch.Tensor]) -> None:
    weights["down.weight"][0, 0] = float("nan")


BREAKAGES: dict[str, tuple[Callable[[Path], object], str]] = {
    "negative vocabulary id": (_edit_weights(_set_id(0, -1)), "vocab_ids span [-1, "),
    "vocabulary id past the target's": (_edit_weights(_set_id(0, 320)), "outside the target's [0, 320)"),
    "repeated vocabulary id": (_edit_weights(_set_id(1, 0)), "vocab_ids repeat a token"),
    "float vocabulary ids": (
        _edit_weights(lambda w: {**w, "vocab_ids": w["vocab_ids"].float()}),
        "vocab_ids are torch.float32",
    ),
    "a tensor of another shape": (_edit_weights(_halve_gate), "gate.weight is (64, 128), not (128, 128)"),
    "a non-finite weight": (_edit_weights(_poison), "down.weight is not finite"),
    "an extra tensor": (_edit_weights(lambda w: {**w, "extra": torch.zeros(1)}), "not the tensors"),
    "weights that are no dict": (_edit_weights(lambda w: list(w.values())), "holds list, not the tensors"),
    "a width given as text": (_edit_config(hidden_size="64"), "hidden_size is '64', not a whole number"),
    "a width given as a float": (_edit_config(intermediate_size=128.0), "intermediate_size is 128.0"),
    "a version given as true": (_edit_config(version=True), "names a head of kind 'recurrent-head' vTrue"),
    "no rows": (_edit_config(vocab_rows=0), "vocab_rows is 0, not >= 1"),
    "more rows than the target has": (_edit_config(vocab_rows=321), "vocab_rows is 321, more than"),
    "another target's width": (_edit_config(hidden_size=96), "trained for a target 96 wide"),
    "another target's vocabulary": (_edit_config(target_vocab_size=999), "with 999 tokens; this one is 64 wide"),
    "an unknown field": (_edit_config(layers=3), "unknown field 'layers'"),
    "a missing field": (
        lambda folder: (folder / HEAD_CONFIG).write_text(json.dumps({"hidden_size": 64})),
        "intermediate_size is None",
    ),
    "a JSON list": (lambda folder: (folder / HEAD_CONFIG).write_text("[64]"), "holds a JSON list"),
    "a padded config": (
        lambda folder: (folder / HEAD_CONFIG).write_text((folder / HEAD_CONFIG).read_text() + " " * 70_000),
        "larger than 65,536 bytes",
    ),
    # the 2 KB config that made the loader allocate gigabytes: its size is held against the file's first
    "a config implying gigabytes": (_edit_config(intermediate_size=10**9), "its config implies"),
    "a truncated weight file": (lambda folder: (folder / HEAD_WEIGHTS).write_bytes(b"truncated"), "bytes of weights"),
}


def _broken(head_dir: Path, into: Path, breakage: Callable[[Path], object]) -> Path:
    folder = into / "broken"
    shutil.copytree(head_dir, folder, ignore=shutil.ignore_patterns(".specq-draft"))
    breakage(folder)
    return folder


@pytest.mark.parametrize("name", BREAKAGES)
def test_a_broken_head_is_refused_by_a_load_in_one_line(tiny_pair, head_dir, tmp_path, name):
    breakage, says = BREAKAGES[name]
    folder = _broken(head_dir, tmp_path, breakage)
    with pytest.raises(ModelLoadError) as refused:
        load_pair(tiny_pair[0], str(folder))
    message = str(refused.value)
    assert says in message and "\n" not in message, message


def test_a_config_implying_gigabytes_is_refused_before_the_weights_are_read_or_anything_built(
    tiny_pair, head_dir, tmp_path, monkeypatch
):
    import specq.decoding.draft_head as draft_head

    folder = _broken(head_dir, tmp_path, _edit_config(intermediate_size=10**9))

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read or built before the config was checked against the file")

    monkeypatch.setattr(draft_head.torch, "load", never)
    monkeypatch.setattr(draft_head.DraftHead, "__init__", never)
    with pytest.raises(ModelLoadError) as refused:
        load_pair(tiny_pair[0], str(folder))
    assert "its config implies 640,000,002,688 to" in str(refused.value)


def _error_line(stderr: str) -> str:
    (line,) = [line for line in stderr.splitlines() if line.startswith("Error: ")]
    return line


@pytest.mark.parametrize("command", ["run", "submit"])
def test_a_head_with_a_negative_vocabulary_id_is_refused_by_run_and_submit_with_exit_2(
    tiny_pair, head_dir, tmp_path, sqlite_url, command
):
    folder = _broken(head_dir, tmp_path, _edit_weights(_set_id(0, -1)))
    path = write_requests(tmp_path / "prompts.jsonl", LINES[:1])
    env = {"SPECQ_HOME": str(tmp_path / "home"), "SPECQ_DATABASE_URL": sqlite_url}
    args = [command, path, "--target", tiny_pair[0], "--draft", str(folder)]
    if command == "run":
        args += ["-o", str(tmp_path / "out.jsonl")]
    result = invoke(args, env)
    assert result.exit_code == 2, result.output
    assert "vocab_ids span [-1, " in _error_line(result.stderr), result.stderr
    assert "Traceback" not in result.output
    if command == "submit":  # nothing stored
        listed = invoke(["status", "--json"], env)
        assert listed.exit_code == 0 and json.loads(listed.stdout) == [], listed.output
