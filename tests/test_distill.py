"""`specq draft train` (distill/): a distilled draft is accepted far more often than an untrained one,
keeps the target's greedy output, resumes after a kill where it stopped, and refuses bad prompts, a
missing target and an existing DIR before doing anything."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from specq.budget import Budget
from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
from specq.distill.corpus import Decoded, Prompt, decode_with_target, load_sequences
from specq.distill.run import train_draft
from specq.distill.settings import DistillSettings, DraftShape
from specq.distill.sizing import build_draft, draft_config
from specq.distill.trainer import CHECKPOINT, StoredTeacher, Teacher, TopK, Trainer, TrainingInterrupted
from specq.distill.workdir import DECODING, SEQUENCES, WORK
from tests.services import invoke, run_alone_and_with_draft, write_requests
from tests.tiny_models import TINY_CORPUS, IdTokenizer, tiny_llama

GREEDY = SamplingParams(max_tokens=32, temperature=0.0)
# acceptance (K = 4, greedy) a distilled draft must gain over an untrained one of the same size. Measured:
# untrained 0.005, distilled 0.32 on the stored top-20 (0.31 on the whole distribution, live), trained on
# shuffled target distributions 0.02 (0.09 with tvd)
MARGIN = 0.15


def _random_prompts(count: int, rng: random.Random) -> list[tuple[int, ...]]:
    return [tuple([0] + [rng.randrange(2, 64) for _ in range(rng.randrange(3, 12))]) for _ in range(count)]


def _shuffled(rows: int) -> torch.Tensor:
    return torch.randperm(rows, generator=torch.Generator().manual_seed(0))


class ShuffledTeacher(Teacher):
    """The target's distributions, each at the wrong position: what a broken pairing of data would teach."""

    def log_probs(self, input_ids, attention_mask, positions):
        log_probs = super().log_probs(input_ids, attention_mask, positions)  # [n, vocab]
        return log_probs[_shuffled(log_probs.shape[0])]


class ShuffledStoredTeacher(StoredTeacher):
    """The stored top tokens, each at the wrong position."""

    def targets(self, batch):
        top = super().targets(batch)
        assert isinstance(top, TopK)
        order = _shuffled(top.ids.shape[0])
        return TopK(top.ids[order], top.logprobs[order])


def _acceptance(target, draft, prompts) -> float:
    engine = SpeculativeEngine(
        target, IdTokenizer(), draft.eval(), DecodingConfig(num_speculative_tokens=4, fixed_k=True, batch_size=16)
    )
    results = list(engine.generate(GenerationRequest(i, p, GREEDY) for i, p in enumerate(prompts)))
    assert all(r.error is None for r in results)
    return engine.stats.acceptance_rate


def tiny_target_data() -> tuple[Any, list[tuple[int, ...]], list[Decoded]]:
    """A tiny random target (frozen), 16 held-out prompts, and its greedy completions of 64 training
    prompts with its top 20 tokens at each position."""
    target = tiny_llama(vocab=64, layers=2, hidden=64, seed=0)
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    rng = random.Random(0)
    train, heldout = _random_prompts(64, rng), _random_prompts(16, rng)
    requests = [Prompt(i, GenerationRequest(i, p, GREEDY)) for i, p in enumerate(train)]
    return target, heldout, decode_with_target(target, IdTokenizer(), requests, batch_size=16, top_k=20)


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """(target, held-out prompts, {name: draft}): an untrained draft, and drafts of the same (default) size
    for the tiny target trained alike on the stored top-20 or on the live distributions, right or
    shuffled."""
    torch.manual_seed(0)
    target, heldout, sequences = tiny_target_data()
    drafts = {"untrained": build_draft(target, DraftShape(), seed=0)}
    teachers: dict[str, Teacher | StoredTeacher] = {
        "stored": StoredTeacher(),
        "stored shuffled": ShuffledStoredTeacher(),
        "live": Teacher(target),
        "live shuffled": ShuffledTeacher(target),
    }
    for name, teacher in teachers.items():
        draft = build_draft(target, DraftShape(), seed=0)
        Trainer(draft, teacher, sequences, Budget(tokens=20_000), checkpoint_every=10**6).run(
            tmp_path_factory.mktemp(name.replace(" ", "-"))
        )
        drafts[name] = draft
    return target, heldout, drafts


@pytest.mark.parametrize("teacher", ["stored", "live"])
def test_distilled_draft_beats_an_untrained_one_by_the_margin(distilled, teacher):
    target, heldout, drafts = distilled
    untrained = _acceptance(target, drafts["untrained"], heldout)
    assert _acceptance(target, drafts[teacher], heldout) >= untrained + MARGIN


@pytest.mark.parametrize("teacher", ["stored", "live"])
def test_the_margin_has_power_a_draft_trained_on_shuffled_targets_misses_it(distilled, teacher):
    target, heldout, drafts = distilled
    untrained = _acceptance(target, drafts["untrained"], heldout)
    assert _acceptance(target, drafts[f"{teacher} shuffled"], heldout) < untrained + MARGIN


def test_greedy_output_with_the_distilled_draft_is_the_targets(distilled):
    target, heldout, drafts = distilled
    requests = [GenerationRequest(i, p, GREEDY) for i, p in enumerate(heldout)]
    alone = {r.key: r.token_ids for r in SpeculativeEngine(target, IdTokenizer()).generate(requests)}
    engine = SpeculativeEngine(target, IdTokenizer(), drafts["stored"], DecodingConfig(num_speculative_tokens=4))
    assert {r.key: r.token_ids for r in engine.generate(requests)} == alone
    assert engine.stats.num_accepted_tokens > 0


# -- the command ------------------------------------------------------------------------------------


def _prompt_lines(count: int) -> list[dict[str, Any]]:
    rng = random.Random(1)
    lines: list[dict[str, Any]] = []
    for i in range(count):
        start = rng.randrange(len(TINY_CORPUS) - 40)
        lines.append({"id": f"p{i}", "prompt": TINY_CORPUS[start : start + rng.randrange(10, 40)]})
    lines.append(
        {
            "custom_id": "chat",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "t", "messages": [{"role": "user", "content": "def add(a, b):"}]},
        }
    )
    return lines


# the draft model (the default is a draft head: tests/test_draft_head.py)
FAST = [
    *("--proposer", "model", "--max-tokens", "16", "--budget", "3000", "--checkpoint-every", "5"),
    *("--eval-warmup", "0", "--no-progress"),
]


def _train(target, data, out, *more):
    return invoke(["draft", "train", "--target", target, "--data", data, "-o", str(out), *FAST, *more])


def test_draft_train_writes_a_folder_that_draft_takes_and_reports_the_held_out_slice(tiny_pair, tmp_path):
    target, _ = tiny_pair
    data = write_requests(tmp_path / "prompts.jsonl", _prompt_lines(24))
    result = _train(target, data, tmp_path / "draft", "--eval-repeats", "2")
    assert result.exit_code == 0, result.output
    assert "held-out (2 prompts, greedy, K=4, batch 1, the target eager): acceptance" in result.stderr
    assert "speed-up over target-only" in result.stderr and "the median of 2 rounds" in result.stderr
    assert "outputs identical to target-only" in result.stderr
    # the draft beside prompt lookup and the suffix index, measured in the same rounds (its outputs are
    # among those checked identical), and the command's advice on which to use
    assert "; with --model-free suffix: acceptance" in result.stderr
    assert f"draft written to {tmp_path / 'draft'}: use it with --draft {tmp_path / 'draft'}" in result.stderr
    assert result.stdout == f"{tmp_path / 'draft'}\n"
    run = json.loads((tmp_path / "draft" / WORK / "run.json").read_text())
    assert run["phase"] == "done" and run["heldout_prompts"] == 2 and run["train_prompts"] == 23
    assert run["evaluation"]["rows"][0]["hybrid_over_target_only"] > 0
    assert run["evaluation"]["repeats"] == 2 and "eval_repeats" not in run["settings"]
    assert not (tmp_path / "draft" / WORK / CHECKPOINT).exists()
    # `--draft DIR` as is: `specq run` with it gives the target's own greedy tokens
    alone, drafted = run_alone_and_with_draft(target, tmp_path / "draft", tmp_path)
    assert drafted["tokens"] == alone["tokens"]
    assert drafted["draft_tokens"] > 0


class Killed(Exception):
    """Stands for a SIGKILL: raised out of the training loop with nothing saved on the way."""


class _Quiet:
    def __init__(
        self,
        kill_after_step: int | None = None,
        ctrl_c_at_step: int | None = None,
        kill_after_decoded: int | None = None,
    ) -> None:
        self.kill_after_step, self.ctrl_c_at_step = kill_after_step, ctrl_c_at_step
        self.kill_after_decoded = kill_after_decoded
        self.steps: list[int] = []  # the training steps this try took
        self.decoded = 0  # prompts this try decoded with the target

    def say(self, message):
        pass

    def decoding(self, done, total, stats):
        self.decoded = done
        if done == self.kill_after_decoded:
            raise Killed

    def reading(self, done, total, tokens):
        pass

    def training(self, state, budget):
        self.steps.append(state.step)
        if state.step == self.kill_after_step:
            raise Killed
        if state.step == self.ctrl_c_at_step:
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C, mid-step as far as the loop knows


def _fast_settings(target: str, data: str) -> DistillSettings:
    return DistillSettings(
        target=target,
        data=data,
        proposer="model",
        sampling=SamplingParams(max_tokens=16, temperature=0.0),
        budget=Budget(tokens=3000),
        checkpoint_every=5,
        eval_warmup=0,
    )


@pytest.fixture(scope="module")
def uninterrupted(tiny_pair, tmp_path_factory):
    """(settings, outcome, folder) of a run that nothing interrupted."""
    target, _ = tiny_pair
    root = tmp_path_factory.mktemp("uninterrupted")
    settings = _fast_settings(target, write_requests(root / "prompts.jsonl", _prompt_lines(24)))
    return settings, train_draft(settings, root / "whole", _Quiet()), root / "whole"


def _same_weights(one: Path, other: Path) -> bool:
    """The same weights up to float rounding: each run's target decode batches its rows as its own measured
    step times say, which moves the recorded log-probabilities in their last bits (two uninterrupted runs
    differ as much)."""
    from safetensors.torch import load_file

    weights = [load_file(folder / "model.safetensors") for folder in (one, other)]
    return weights[0].keys() == weights[1].keys() and all(
        torch.allclose(weights[0][k], weights[1][k], rtol=1e-4, atol=1e-5) for k in weights[0]
    )


def test_a_killed_run_resumes_from_its_checkpoint_to_the_same_checkpoints_and_weights(uninterrupted, tmp_path):
    settings, whole, whole_dir = uninterrupted
    with pytest.raises(Killed):  # killed 2 steps after its 2nd checkpoint: those 2 steps are lost
        train_draft(settings, tmp_path / "resumed", _Quiet(kill_after_step=12))
    saved = torch.load(tmp_path / "resumed" / WORK / CHECKPOINT, weights_only=True)
    assert saved["state"]["step"] == 10 and saved["state"]["checkpoints"] == 2
    rerun = _Quiet()
    resumed = train_draft(settings, tmp_path / "resumed", rerun)
    assert resumed.resumed and rerun.decoded == 0 and rerun.steps[0] == 11  # from the checkpoint, not afresh
    assert resumed.state["checkpoints"] == whole.state["checkpoints"] >= 3
    assert resumed.state["step"] == whole.state["step"] and resumed.state["tokens"] == whole.state["tokens"]
    assert _same_weights(whole_dir, tmp_path / "resumed")


def test_ctrl_c_finishes_the_step_checkpoints_it_and_the_rerun_continues_from_there(uninterrupted, tmp_path):
    settings, whole, whole_dir = uninterrupted
    handler = signal.getsignal(signal.SIGINT)  # Python's default; SIG_IGN in a pytest-xdist worker
    with pytest.raises(TrainingInterrupted, match="interrupted at step 7"):
        train_draft(settings, tmp_path / "out", _Quiet(ctrl_c_at_step=7))
    saved = torch.load(tmp_path / "out" / WORK / CHECKPOINT, weights_only=True)
    assert saved["state"]["step"] == 7 and saved["state"]["checkpoints"] == 1  # step 7 is no scheduled one
    assert signal.getsignal(signal.SIGINT) is handler  # Ctrl-C is what it was again
    rerun = _Quiet()
    resumed = train_draft(settings, tmp_path / "out", rerun)
    assert rerun.decoded == 0 and rerun.steps[0] == 8
    assert resumed.state["checkpoints"] == whole.state["checkpoints"]
    assert _same_weights(whole_dir, tmp_path / "out")


def test_a_run_killed_while_the_target_decodes_decodes_only_the_rest(uninterrupted, tmp_path):
    settings, whole, whole_dir = uninterrupted
    with pytest.raises(Killed):
        train_draft(settings, tmp_path / "out", _Quiet(kill_after_decoded=5))
    stored = tmp_path / "out" / WORK / DECODING
    lines = stored.read_bytes().split(b"\n")
    assert len(lines) == 6 and lines[-1] == b""  # 5 whole lines
    stored.write_bytes(b"\n".join(lines[:4]) + b"\n" + lines[4][: len(lines[4]) // 2])  # the 5th torn mid-write
    rerun = _Quiet(kill_after_step=1)  # training resumes as the tests above say: stop at its first step
    with pytest.raises(Killed):
        train_draft(settings, tmp_path / "out", rerun)
    assert rerun.decoded == whole.train_prompts - 4 and not stored.exists()
    resumed, uninterrupted_run = (load_sequences(folder / WORK / SEQUENCES) for folder in (tmp_path / "out", whole_dir))
    assert len(resumed) == len(uninterrupted_run) == whole.train_prompts
    for one, other in zip(resumed, uninterrupted_run, strict=True):  # in the prompts' order
        assert (one.prompt, one.completion, one.top_ids) == (other.prompt, other.completion, other.top_ids)
        # the log-probabilities up to float rounding: the two tries batched their rows differently
        assert torch.allclose(torch.tensor(one.top_logprobs), torch.tensor(other.top_logprobs), atol=1e-5)


def test_an_unfinished_run_with_other_settings_is_refused(tiny_pair, tmp_path):
    target, _ = tiny_pair
    data = write_requests(tmp_path / "prompts.jsonl", _prompt_lines(24))
    settings = _fast_settings(target, data)
    with pytest.raises(Killed):
        train_draft(settings, tmp_path / "out", _Quiet(kill_after_step=3))
    result = _train(target, data, tmp_path / "out", "--loss", "tvd")
    assert result.exit_code == 2, result.output
    assert "holds an unfinished run with other settings (loss); rerun it with the same ones" in result.stderr
    assert _train(target, data, tmp_path / "out").exit_code == 0  # the same ones resume it


def test_bad_prompt_lines_are_refused_whole_before_anything_is_written(tiny_pair, tmp_path):
    target, _ = tiny_pair
    lines = [*_prompt_lines(4), "not json", {"id": "p1", "prompt": "again"}, {"prompt": ""}]
    data = write_requests(tmp_path / "prompts.jsonl", lines)
    result = _train(target, data, tmp_path / "out")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith(f"{data}:")]
    assert [line.split(":")[1] for line in errors] == ["6", "7", "8"]
    assert "3 bad lines; nothing was done" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_missing_target_is_a_usage_error_before_anything_is_written(tmp_path):
    data = write_requests(tmp_path / "prompts.jsonl", _prompt_lines(4))
    result = _train(str(tmp_path / "no-such-model"), data, tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "no-such-model" in result.stderr
    assert not (tmp_path / "out").exists()


def test_an_existing_dir_is_refused_unless_overwrite(tiny_pair, tmp_path):
    target, _ = tiny_pair
    data = write_requests(tmp_path / "prompts.jsonl", _prompt_lines(8))
    out = tmp_path / "out"
    out.mkdir()
    result = _train(target, data, out)
    assert result.exit_code == 2, result.output
    assert f"{out} exists; give another DIR, or --overwrite to replace it" in result.stderr
    assert list(out.iterdir()) == []
    assert _train(target, data, out, "--overwrite").exit_code == 0
    again = _train(target, data, out)  # a finished run is an existing DIR too
    assert again.exit_code == 2 and "exists" in again.stderr
    other = tmp_path / "notes"
    other.mkdir()
    (other / "thesis.txt").write_text("years of work")
    refused = _train(target, data, other, "--overwrite")
    assert refused.exit_code == 2 and "is not a folder `specq draft train` wrote" in refused.stderr
    assert (other / "thesis.txt").read_text() == "years of work"


# -- the parts --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "budget"),
    [
        ("200000", Budget(tokens=200_000)),
        ("200k", Budget(tokens=200_000)),
        ("2M", Budget(tokens=2_000_000)),
        ("5000 tokens", Budget(tokens=5000)),
        ("30m", Budget(seconds=1800)),
        ("90s", Budget(seconds=90)),
    ],
)
def test_budgets_are_tokens_or_training_time(text, budget):
    assert Budget.parse(text) == budget


@pytest.mark.parametrize("text", ["", "0", "-5", "lots", "3x"])
def test_a_bad_budget_is_refused_with_a_sentence(text):
    with pytest.raises(ValueError, match="is not a budget"):
        Budget.parse(text)


def test_the_draft_is_sized_from_the_target():
    from transformers import LlamaConfig

    # SmolLM2-135M's shape
    smollm2 = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    config = draft_config(smollm2, DraftShape())
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (4, 288, 768)
    assert config.num_attention_heads * config.head_dim == 288 and config.num_key_value_heads == 3
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert draft_config(smollm2, DraftShape(layers=2, hidden=576)).head_dim == 64


def test_the_draft_starts_from_the_targets_embedding():
    target = tiny_llama(vocab=64, layers=2, hidden=64, seed=0)
    same_width = build_draft(target, DraftShape(hidden=64), seed=0)
    assert torch.equal(same_width.get_input_embeddings().weight, target.get_input_embeddings().weight)
    narrow = build_draft(target, DraftShape(), seed=0)
    embed = target.get_input_embeddings().weight.detach()  # [vocab, 64]
    # projected on the top 32 right-singular vectors: the same inner products, as far as 32 directions keep them
    kept = narrow.get_input_embeddings().weight.detach()  # [vocab, 32]
    error = (kept @ kept.T - embed @ embed.T).norm() / (embed @ embed.T).norm()
    assert error < 0.5


@pytest.mark.parametrize(
    ("max_tokens", "window", "positions", "tops"),
    [
        (100, (10, 11, 12, 13, 14, 20, 21, 22, 23), (4, 8), (0, 1, 2, 3)),  # whole: prompt's last token on
        (6, (13, 14, 20, 21, 22, 23), (1, 5), (0, 1, 2, 3)),  # the prompt's start cut
        (3, (21, 22, 23), (0, 2), (2, 3)),  # into the completion: its first tokens lose their positions
    ],
)
def test_a_window_trains_each_position_on_the_next_tokens_own_stored_distribution(max_tokens, window, positions, tops):
    from specq.distill.corpus import Decoded
    from specq.distill.trainer import Window

    # completion token i's stored top tokens are tagged (i,): the row at position p must be the next token's
    sequence = Decoded((10, 11, 12, 13, 14), (20, 21, 22, 23), tuple((i,) for i in range(4)), ((0.0,),) * 4)
    got = Window.of(sequence, max_tokens, final_position=False)
    assert got.token_ids == window and (got.loss_start, got.loss_end) == positions
    assert got.top_ids == tuple((i,) for i in tops)
    for offset, position in enumerate(range(*positions)):  # position p predicts token p + 1
        assert 20 + got.top_ids[offset][0] == got.token_ids[position + 1]
    live = Window.of(sequence, max_tokens, final_position=True)  # the live teacher also trains the last one
    assert (live.loss_start, live.loss_end) == (positions[0], positions[1] + 1)


def _report(*rows: tuple[int, float, float | None]) -> dict:
    """An evaluation report of (batch size, the draft's speed-up, the hybrid's) rows."""
    return {
        "rows": [
            {"batch_size": b, "spec_over_target_only": alone, "hybrid_over_target_only": hybrid}
            for b, alone, hybrid in rows
        ]
    }


@pytest.mark.parametrize(
    ("report", "advice"),
    [
        (_report((1, 1.46, 1.62), (16, 1.03, 1.11)), ": use it with --draft D --model-free suffix (the faster"),
        (
            _report((1, 1.46, 1.62), (16, 1.05, 1.01)),
            ": use it with --draft D, and --model-free suffix beside it at batch sizes like 1 ",
        ),
        (_report((1, 1.46, 1.40)), ": use it with --draft D"),
        (_report((1, 1.46, None)), ": use it with --draft D"),  # measured by an earlier release: no hybrid
    ],
    ids=["hybrid-everywhere", "hybrid-at-1", "alone", "not-measured"],
)
def test_the_command_advises_the_hybrid_where_it_measured_faster(report, advice):
    from specq.distill.evaluate import usage_line

    line = usage_line(report, "D")
    assert line.startswith("draft written to D") and advice in line
    if "--model-free" not in advice:
        assert "--model-free" not in line
