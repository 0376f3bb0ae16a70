"""The demo's showcase (issue 51, item 7): the answers scripts/demo prints first are ones SmolLM2-135M-
Instruct gets right. Decoding is greedy, so a wrong answer there is wrong every time: each showcase task
(examples/chat_showcase.json: task id -> a fact its answer must state) is decoded as the demo decodes it
(its GGUF file, `submit --draft ngram --temperature 0 --wait` on the embedded store) and its answer must
contain that fact."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from specq.models import gguf
from tests.real_models import smollm2_gguf
from tests.services import invoke, services_env, write_requests

pytestmark = pytest.mark.real

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def showcase() -> dict[str, str]:
    return json.loads((EXAMPLES / "chat_showcase.json").read_text(encoding="utf-8"))


def showcase_lines() -> list[dict]:
    wanted = showcase()
    lines = [json.loads(line) for line in (EXAMPLES / "chat_tasks.jsonl").read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line["custom_id"] in wanted]


@pytest.fixture
def env(tmp_path):
    """An isolated home whose GGUF cache is the shared one, so the file is not converted again."""
    from specq.paths import data_dir

    home = tmp_path / "home"
    home.mkdir()
    (home / gguf.CACHE_DIR).symlink_to(data_dir() / gguf.CACHE_DIR, target_is_directory=True)
    return services_env(f"sqlite:///{tmp_path / 'specq.db'}", None, home)


def test_the_showcase_tasks_are_in_the_demo_batch() -> None:
    assert len(showcase_lines()) == len(showcase()) >= 3


def test_the_model_answers_every_showcase_task_right(env, tmp_path) -> None:
    gguf.resolve(str(smollm2_gguf()))  # converted once into the shared cache, before the isolated home links it
    tasks = write_requests(tmp_path / "showcase.jsonl", showcase_lines())
    submitted = ["submit", tasks, "--target", str(smollm2_gguf().parent), "--draft", "ngram", "--temperature", "0"]
    result = invoke([*submitted, "--wait"], env)
    assert result.exit_code == 0, result.output
    out = tmp_path / "answers.csv"
    result = invoke(["export", result.stdout.strip(), "-o", str(out)], env)
    assert result.exit_code == 0, result.output
    with open(out, newline="", encoding="utf-8") as handle:
        answers = {row["id"]: row["completion"] for row in csv.DictReader(handle)}
    wrong = {task: answers[task] for task, fact in showcase().items() if fact.lower() not in answers[task].lower()}
    assert not wrong, wrong
