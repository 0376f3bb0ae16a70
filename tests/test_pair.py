"""The pair tier: the seed's method on real weights, a pretrained draft for a pretrained target, by name.

Qwen2.5-Coder-1.5B-Instruct (the target) and Qwen2.5-Coder-0.5B-Instruct (its draft) share a tokenizer;
both come from the catalogue (models/catalogue.py), pulled, checked and converted once into the user's
data directory. Greedy decoding is token for token transformers' `generate`, for the target alone, the
draft and the draft beside the suffix index (the hybrid), one request at a time and three ragged chat
prompts together; seeded sampling is the same whatever the proposer; a job through a real worker (by
name, over PostgreSQL and Redis) exports OpenAI Batch lines that the `openai` package validates, with the
same tokens as the target alone. Kept lean (three short chats, 16 tokens): it runs in CI, where the 1.5B
model decodes a few tokens a second. `pytest -m pair` selects it.

The worker test comes first: its worker process holds the pair while it runs, and this process loads
its own copy only after it (the module fixtures), so that two copies of 8 GB are never resident at once.
"""

from __future__ import annotations

import inspect
import json
import shlex
import textwrap
from pathlib import Path

import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.models import gguf
from specq.models.loading import load_pair, tokenize_prompt
from specq.models.names import resolve
from tests.services import SpecqWorker, invoke, services_env, submit_job, wait_state, write_requests

pytestmark = pytest.mark.pair

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
MAX_TOKENS = 16


def chat_lines() -> list[list[dict[str, str]]]:
    """Three ragged chats: two code edits (what the draft and the suffix index speed up) and a question."""
    edits = [
        [{"role": "user", "content": f"Add type hints to this function:\n\n{inspect.getsource(function)}"}]
        for function in (shlex.quote, textwrap.dedent)
    ]
    return [*edits, [{"role": "user", "content": "In one sentence: what does a Python list comprehension do?"}]]


# -- the pair, pulled and converted once into the user's data dir (session fixtures run before isolation) --
@pytest.fixture(scope="session")
def pair_files() -> tuple[Path, Path]:
    return Path(resolve(TARGET)), Path(resolve(DRAFT))


@pytest.fixture(scope="session")
def gguf_cache(pair_files) -> Path:
    from specq.paths import data_dir

    for file in pair_files:
        gguf.resolve(str(file))  # converted now, outside any test's time limit and isolated home
    return data_dir() / gguf.CACHE_DIR


@pytest.fixture
def home(tmp_path, gguf_cache, pair_files) -> Path:
    """An isolated home whose catalogue files and GGUF cache are the shared ones: nothing is pulled or
    converted again."""
    from specq.models import catalogue
    from specq.models.catalogue import find

    home = tmp_path / "home"
    home.mkdir()
    (home / gguf.CACHE_DIR).symlink_to(gguf_cache, target_is_directory=True)
    for name, file in zip((TARGET, DRAFT), pair_files, strict=True):
        model = find(name)
        assert model is not None
        place = home / catalogue.CACHE_DIR / model.name / model.file_name
        place.parent.mkdir(parents=True)
        place.symlink_to(file)
    return home


# -- a job by name through a real worker -------------------------------------------------------------------
def test_a_pair_job_by_name_through_a_worker_exports_valid_openai_lines_with_the_targets_tokens(
    home, pg_db_url, redis_url, tmp_path
) -> None:
    from openai.types.chat import ChatCompletion

    env = services_env(pg_db_url, redis_url, home)
    lines = [
        {
            "custom_id": f"chat-{number}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "qwen-coder", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0},
        }
        for number, messages in enumerate(chat_lines())
    ]
    path = write_requests(tmp_path / "in.jsonl", lines)
    worker = SpecqWorker(env, tmp_path / "worker.log").wait_ready()
    try:
        jobs = {
            "pair": submit_job(env, path, "--target", TARGET, "--draft", DRAFT, "--model-free", "suffix"),
            "alone": submit_job(env, path, "--target", TARGET),
        }
        for job_id in jobs.values():
            info = wait_state(env, job_id, {"completed", "failed", "cancelled"}, timeout=900)
            assert info["state"] == "completed", worker.output()
    finally:
        worker.stop()
    exported = {}
    for name, job_id in jobs.items():
        out = tmp_path / f"{name}.jsonl"
        result = invoke(["export", job_id, "-o", str(out), "--format", "openai"], env)
        assert result.exit_code == 0, result.output
        exported[name] = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [line["custom_id"] for line in exported["pair"]] == [line["custom_id"] for line in lines]
    bodies = {
        name: [ChatCompletion.model_validate(line["response"]["body"]) for line in rows]
        for name, rows in exported.items()
    }
    assert [b.choices[0].message.content for b in bodies["pair"]] == [
        b.choices[0].message.content for b in bodies["alone"]
    ]
    assert all(b.usage is not None and 0 < b.usage.completion_tokens <= MAX_TOKENS for b in bodies["pair"])
    assert job_accepted_tokens(env, jobs["pair"]) > 0  # the draft's tokens were taken, not only verified


def job_accepted_tokens(env, job_id: str) -> int:
    result = invoke(["status", job_id, "--json"], env)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["num_accepted_tokens"]


# -- the engine on the pair, against transformers' own greedy `generate` -----------------------------------
@pytest.fixture(scope="module")
def pair(gguf_cache, pair_files):
    return load_pair(str(pair_files[0]), str(pair_files[1]), "cpu", "float32")


@pytest.fixture(scope="module")
def chats(pair) -> list[list[int]]:
    return [tokenize_prompt(pair.tokenizer, messages=messages) for messages in chat_lines()]


@pytest.fixture(scope="module")
def references(pair, chats) -> list[list[int]]:
    from specq.decoding.packed_linear import plain_linears

    eos = pair.tokenizer.eos_token_id
    references = []
    with torch.inference_mode(), plain_linears():  # transformers as it runs stock, not on specq's packed weights
        for ids in chats:
            out = pair.target.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos
            )[0, len(ids) :].tolist()
            references.append(out[: out.index(eos)] if eos in out else out)
    return references


def decode(pair, prompts, params, *, draft: bool, proposer=None, batch_size=3) -> list:
    config = DecodingConfig(batch_size=batch_size, model_free=proposer)
    engine = SpeculativeEngine(pair.target, pair.tokenizer, pair.draft if draft else None, config)
    requests = [GenerationRequest(key, tuple(ids), params) for key, ids in enumerate(prompts)]
    return sorted(engine.generate(requests), key=lambda result: result.key)


def test_the_pair_shares_the_tokenizer_and_the_chat_template_ends_turns_at_eos(pair, chats) -> None:
    assert pair.tokenizer.eos_token == "<|im_end|>" and pair.tokenizer.eos_token_id == 151645
    assert len({len(ids) for ids in chats}) == len(chats)  # ragged


@pytest.mark.parametrize(
    ("draft", "proposer", "batch_size"),
    [(False, None, 1), (False, None, 3), (True, None, 1), (True, None, 3), (True, "suffix", 3)],
    ids=["target-alone-b1", "target-alone-b3", "draft-b1", "draft-b3", "hybrid-b3"],
)
def test_greedy_is_generate(pair, chats, references, draft, proposer, batch_size) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = decode(pair, chats, params, draft=draft, proposer=proposer, batch_size=batch_size)
    assert [r.token_ids for r in results] == references
    if draft:
        assert sum(r.accepted_tokens for r in results) > 0  # the 0.5B model agrees with the 1.5B often


def test_seeded_sampling_is_the_same_whatever_the_proposer(pair, chats) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=11)
    alone = decode(pair, chats, params, draft=False)
    drafted = decode(pair, chats, params, draft=True)
    hybrid = decode(pair, chats, params, draft=True, proposer="suffix")
    tokens = [[r.token_ids for r in results] for results in (alone, drafted, hybrid)]
    assert tokens[0] == tokens[1] == tokens[2]
