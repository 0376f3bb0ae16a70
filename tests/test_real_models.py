"""The real-model tier: specq on pretrained models users bring, as GGUF files (tests/real_models.py).

SmolLM2-135M-Instruct on chat lines rendered with its own template (turns end at `<|im_end|>`, its EOS)
that ask for edits of standard-library functions, the work prompt lookup speeds up: greedy decoding is
token for token transformers' `generate`, target-only, with prompt lookup, the suffix index and the
hybrid, one request at a time and four ragged ones together; log-probabilities are a plain forward's;
seeded sampling is the same whatever the proposer. Gemma 3 270M decodes prompts longer than its
512-token sliding window exactly as `generate` does. The CLI takes the GGUF file itself, and its OpenAI
export validates against the `openai` package's types. Kept lean (short prompts, few tokens): the tier
runs in CI. `pytest -m real` selects it.
"""

from __future__ import annotations

import inspect
import json
import os
import shlex
import string
import textwrap
from pathlib import Path

import pytest
import torch

from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.models import gguf
from specq.models.loading import load_pair, tokenize_prompt
from tests.real_models import GEMMA3_SLIDING_WINDOW, gemma3_gguf, smollm2_gguf
from tests.services import invoke, services_env, write_requests

pytestmark = pytest.mark.real

MAX_TOKENS = 16
# Ragged chat lines: edits of given code (prompt lookup's case) and one short question that ends at EOS.
EDITED = (string.capwords, shlex.quote, textwrap.indent)
QUESTION = "What is the capital of France? Answer in one word."


def chat_lines() -> list[list[dict[str, str]]]:
    edits = [
        [{"role": "user", "content": f"Add type hints to this function:\n\n{inspect.getsource(function)}"}]
        for function in EDITED
    ]
    return [*edits, [{"role": "user", "content": QUESTION}]]


# -- the models, converted once into the user's data dir (session fixtures run before the isolation) ----
@pytest.fixture(scope="session")
def smollm2_file() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_folder(smollm2_file) -> str:
    return gguf.resolve(str(smollm2_file))


@pytest.fixture(scope="session")
def gemma3_file() -> Path:
    return gemma3_gguf()


@pytest.fixture(scope="session")
def gemma3_folder(gemma3_file) -> str:
    return gguf.resolve(str(gemma3_file))


@pytest.fixture(scope="session")
def gguf_cache() -> Path:
    from specq.paths import data_dir

    return data_dir() / gguf.CACHE_DIR


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
    return load_pair(smollm2_folder)


@pytest.fixture(scope="module")
def chats(smollm2) -> list[list[int]]:
    return [tokenize_prompt(smollm2.tokenizer, messages=messages) for messages in chat_lines()]


def generate(model, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    """transformers' greedy `generate` for one prompt, EOS excluded (the engine reports none)."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )[0, len(prompt) :].tolist()
    return out[: out.index(eos)] if eos in out else out


@pytest.fixture(scope="module")
def references(smollm2, chats) -> list[list[int]]:
    with torch.inference_mode():
        return [generate(smollm2.target, ids, MAX_TOKENS, smollm2.tokenizer.eos_token_id) for ids in chats]


def decode(pair, prompts, params, proposer=None, batch_size=4, draft=None) -> list:
    config = DecodingConfig(batch_size=batch_size, model_free=proposer)
    engine = SpeculativeEngine(pair.target, pair.tokenizer, draft, config)
    requests = [GenerationRequest(key, tuple(ids), params) for key, ids in enumerate(prompts)]
    return sorted(engine.generate(requests), key=lambda result: result.key)


# -- SmolLM2 -------------------------------------------------------------------------------------------
def test_the_chat_template_and_eos_come_from_the_file(smollm2, chats) -> None:
    tokenizer = smollm2.tokenizer
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.decode(chats[-1])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("proposer", [None, "ngram", "suffix"])
def test_greedy_is_generate(smollm2, chats, references, proposer, batch_size) -> None:
    results = decode(smollm2, chats, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), proposer, batch_size)
    assert [r.token_ids for r in results] == references
    # the question ends at <|im_end|>, the edits run to the limit
    assert [r.finish_reason for r in results] == ["length"] * len(EDITED) + ["stop"]
    if proposer is not None:
        assert sum(r.accepted_tokens for r in results) > 0  # the edits copy their given code


def test_the_hybrid_with_a_draft_model_is_generate(smollm2, chats, references) -> None:
    # the target drafting for itself: the only draft model that shares SmolLM2's vocabulary here
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    results = decode(smollm2, chats, params, "ngram", 4, draft=smollm2.target)
    assert [r.token_ids for r in results] == references
    assert sum(r.accepted_tokens for r in results) > 0


def test_logprobs_are_a_plain_forward(smollm2, chats) -> None:
    (result,) = decode(smollm2, chats[:1], SamplingParams(max_tokens=12, temperature=0.0, logprobs=3), "ngram", 1)
    ids = chats[0] + result.token_ids
    with torch.inference_mode():
        logits = smollm2.target(torch.tensor([ids])).logits[0, len(chats[0]) - 1 : -1]  # [completion, vocab]
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    for position, entry in enumerate(result.logprobs):
        assert entry.token_id == result.token_ids[position]
        assert entry.logprob == pytest.approx(expected[position, entry.token_id].item(), abs=1e-4)
        top = torch.topk(expected[position], 3)
        assert [token_id for token_id, _, _ in entry.top] == top.indices.tolist()
        assert [logprob for _, _, logprob in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_seeded_sampling_is_the_same_whatever_the_proposer(smollm2, chats) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=7)
    runs = {proposer: decode(smollm2, chats, params, proposer) for proposer in (None, "ngram", "suffix")}
    alone = decode(smollm2, chats, params, None, batch_size=1)
    tokens = {proposer: [r.token_ids for r in results] for proposer, results in runs.items()}
    assert tokens["ngram"] == tokens["suffix"] == tokens[None] == [r.token_ids for r in alone]


# -- Gemma 3: prompts past its sliding window -----------------------------------------------------------
def test_gemma3_past_its_sliding_window_is_generate(gemma3_folder) -> None:
    pair = load_pair(gemma3_folder)
    assert pair.target.config.sliding_window == GEMMA3_SLIDING_WINDOW
    source = inspect.getsource(textwrap)
    prompts = [tokenize_prompt(pair.tokenizer, prompt=source[:length]) for length in (2200, 2600)]
    assert all(len(ids) > GEMMA3_SLIDING_WINDOW + 8 for ids in prompts), [len(ids) for ids in prompts]
    assert len(prompts[0]) != len(prompts[1])
    eos = pair.tokenizer.eos_token_id
    with torch.inference_mode():
        expected = [generate(pair.target, ids, 8, eos) for ids in prompts]
    for proposer in (None, "ngram"):
        results = decode(pair, prompts, SamplingParams(max_tokens=8, temperature=0.0), proposer, 2)
        assert [r.token_ids for r in results] == expected, proposer


# -- the CLI on the GGUF file itself --------------------------------------------------------------------
@pytest.fixture
def env(tmp_path, gguf_cache):
    """An isolated home whose GGUF cache is the shared one, so the file is not converted again."""
    home = tmp_path / "home"
    home.mkdir()
    (home / gguf.CACHE_DIR).symlink_to(gguf_cache, target_is_directory=True)
    return services_env(f"sqlite:///{tmp_path / 'specq.db'}", None, home)


def test_submit_and_export_a_chat_batch_on_the_gguf_file(env, smollm2_file, references, tmp_path) -> None:
    lines = [
        {
            "custom_id": f"chat-{number}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "smollm2", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0},
        }
        for number, messages in enumerate(chat_lines())
    ]
    path = write_requests(tmp_path / "in.jsonl", lines)
    result = invoke(["submit", path, "--target", str(smollm2_file), "--draft", "ngram", "--wait"], env)
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip()
    out = tmp_path / "out.jsonl"
    result = invoke(["export", job_id, "-o", str(out), "--format", "openai"], env)
    assert result.exit_code == 0, result.output
    from openai.types.chat import ChatCompletion

    from specq.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(smollm2_file))
    exported = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [line["custom_id"] for line in exported] == [line["custom_id"] for line in lines]
    for line, expected in zip(exported, references, strict=True):
        body = ChatCompletion.model_validate(line["response"]["body"])
        assert body.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
        assert body.usage is not None and body.usage.completion_tokens == len(expected)
    assert body.choices[0].finish_reason == "stop"  # the question's answer ended at <|im_end|>


def test_a_job_that_trains_its_draft_head_on_smollm2_is_generate(env, smollm2_file, references, tmp_path) -> None:
    # the same four chats twice: the second four speculate with the head trained on the first four
    lines = [
        {"custom_id": f"chat-{number}-{copy}", "body": {"messages": messages, "max_tokens": MAX_TOKENS}}
        for copy in range(2)
        for number, messages in enumerate(chat_lines())
    ]
    lines = [{**line, "method": "POST", "url": "/v1/chat/completions"} for line in lines]
    path = write_requests(tmp_path / "in.jsonl", lines)
    args = ["--target", str(smollm2_file), "--draft", "train:4:20k", "--temperature", "0", "--fixed-k"]
    result = invoke(["submit", path, *args, "--batch-size", "4", "--wait"], env)
    assert result.exit_code == 0, result.output
    job_id = result.stdout.strip()
    info = json.loads(invoke(["status", job_id, "--json"], env).stdout)
    assert info["draft_training"]["state"] == "ready" and info["draft_training"]["trained_on"] == 4
    assert info["num_accepted_tokens"] > 0
    out = tmp_path / "out.jsonl"
    assert invoke(["export", job_id, "-o", str(out)], env).exit_code == 0
    exported = [json.loads(line)["tokens"] for line in out.read_text(encoding="utf-8").splitlines()]
    assert exported == [*references, *references]


def one_line(output: str) -> str:
    (line,) = [line for line in output.splitlines() if line.startswith("Error: ")]
    return line


def test_a_draft_gguf_of_another_vocabulary_is_refused(env, smollm2_file, gemma3_file, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", [{"prompt": "def add(a, b):", "max_tokens": 4}])
    for command in (["run", path, "-o", str(tmp_path / "out.jsonl")], ["submit", path]):
        result = invoke([*command, "--target", str(smollm2_file), "--draft", str(gemma3_file)], env)
        assert result.exit_code == 2, result.output
        line = one_line(result.output)
        assert "does not share the vocabulary" in line and str(gemma3_file) in line


# -- bad GGUF files: no real model needed beyond a slice of one -----------------------------------------
def test_a_truncated_gguf_is_refused_naming_it(env, smollm2_file, tmp_path) -> None:
    truncated = tmp_path / "cut.gguf"
    with open(smollm2_file, "rb") as whole:
        truncated.write_bytes(whole.read(4 << 20))
    path = write_requests(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 4}])
    for command in (["run", path, "-o", str(tmp_path / "out.jsonl")], ["submit", path]):
        result = invoke([*command, "--target", str(truncated)], env)
        assert result.exit_code == 2, result.output
        assert f"cannot load the GGUF file {str(truncated)!r}" in one_line(result.output)
    assert not [p for p in (Path(env["SPECQ_HOME"]) / gguf.CACHE_DIR).iterdir() if "tmp" in p.name]


def test_an_architecture_transformers_cannot_load_is_refused(env, tmp_path) -> None:
    from gguf import GGUFWriter

    model = tmp_path / "odd.gguf"
    writer = GGUFWriter(str(model), "specq-odd")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path = write_requests(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 4}])
    result = invoke(["submit", path, "--target", str(tmp_path)], env)  # the folder holding it
    assert result.exit_code == 2, result.output
    assert f"cannot load the GGUF file {str(model)!r}" in one_line(result.output)


def test_a_missing_path_and_a_missing_extra_are_one_line(env, tmp_path) -> None:
    path = write_requests(tmp_path / "in.jsonl", [{"prompt": "hi", "max_tokens": 4}])
    missing = tmp_path / "nowhere" / "model.gguf"
    result = invoke(["run", path, "-o", str(tmp_path / "out.jsonl"), "--target", str(missing)], env)
    assert result.exit_code == 2, result.output
    assert one_line(result.output) == f"Error: the GGUF file {str(missing)!r} does not exist"


def test_without_the_extra_the_error_names_it(tmp_path) -> None:
    import subprocess
    import sys

    # a `gguf` that cannot be imported, first on the path: as where the extra is not installed
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "gguf.py").write_text("raise ImportError('not installed')\n")
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    script = (
        "from specq.models import gguf\n"
        "from specq.errors import ModelLoadError\n"
        f"try:\n    gguf.converted_folder(__import__('pathlib').Path({str(model)!r}))\n"
        "except ModelLoadError as exc:\n    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}
    env["SPECQ_HOME"] = str(tmp_path / "home")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"loading the GGUF file {str(model)!r} needs gguf: pip install 'specq[gguf]'"
