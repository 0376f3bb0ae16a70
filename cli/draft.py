"""`specq draft train --target T --data PROMPTS.jsonl -o DIR`: distil a draft for the target (distill/)."""

from __future__ import annotations

import sys
import time
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from specq.cli.group import cli
from specq.cli.options import (
    DTYPES,
    Duration,
    compile_option,
    float_range,
    input_limit_options,
    int_range,
    specq_errors,
)
from specq.cli.progress import PLAIN_EVERY_S, ProgressBar
from specq.limits import BATCH_SIZE, BENCH_SPECULATIVE_TOKENS, MAX_TOKENS, SEED, TEMPERATURE, TOP_K, TOP_P
from specq.speaking import Speaker

if TYPE_CHECKING:
    from specq.budget import Budget
    from specq.decoding.stats import EngineStats
    from specq.distill.trainer import TrainState
    from specq.jobs.inputs import InputLimits


def _budget(ctx: click.Context, param: click.Parameter, value: str) -> Budget:
    from specq.budget import Budget

    try:
        return Budget.parse(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _batch_sizes(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"expected comma-separated positive integers, got {value!r}")
    return sizes


@cli.group("draft")
def draft() -> None:
    """Draft models for speculative decoding."""


@draft.command("train")
@click.option(
    "--target",
    envvar="SPECQ_TARGET",
    required=True,
    help="Target model: a Hugging Face id, a local folder, or a GGUF file (or a folder holding one; needs the gguf "
    "extra). [env: SPECQ_TARGET]",
)
@click.option(
    "--data",
    "data_path",
    metavar="PROMPTS.jsonl",
    required=True,
    type=click.Path(exists=True, dir_okay=False, allow_dash=True),
    help="The prompts, a job file as `submit` takes it (plain or OpenAI lines; - for standard input).",
)
@click.option(
    "-o",
    "--output",
    "output_dir",
    metavar="DIR",
    required=True,
    type=click.Path(path_type=Path),
    help="The draft's folder (a Hugging Face model folder with the target's tokenizer, for --draft DIR). It may "
    "not be, hold or lie inside the target's folder or specq's data directory, nor hold the data file (a new "
    "folder beside it is fine).",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Replace DIR if `specq draft train` wrote it (it holds .specq-draft/run.json); any other folder, a "
    "symbolic link included, is refused untouched.",
)
@click.option(
    "--budget",
    default="200k",
    show_default=True,
    callback=_budget,
    help="How much to train: tokens (200000, 200k, 2M) or training time (90s, 30m, 1h). It bounds the training "
    "phase alone (a head's includes the target's read of its hidden states), not the target's decoding before it "
    "nor the held-out measurement after it: --time-limit bounds the whole command.",
)
@click.option(
    "--time-limit",
    type=Duration(),
    help="A bound on the whole command, from its start to its last line (e.g. 30m, 2h): reading the prompts, "
    "loading the target, a probe of its speed, its decoding of the training prompts, a head's read of the hidden "
    "states, training and the held-out measurement. The plan printed before the decoding fits them in: fewer "
    "training prompts decoded (a seeded sample) and training stopped early (never past --budget). A limit that "
    "cannot fit one prompt's decode, 10s of training and the measurement is refused before the decoding. A "
    "resumed run's limit counts that try alone. [default: none]",
)
@click.option(
    "--proposer",
    type=click.Choice(("model", "head")),
    default="head",
    show_default=True,
    help="What to train: a draft head on the target's hidden states, or a stand-alone draft model (docs/draft-"
    "train.md measures both).",
)
@click.option(
    "--head-vocab",
    type=click.IntRange(min=1),
    default=8192,
    show_default=True,
    help="A head's vocabulary: the target's most said tokens it may propose.",
)
@click.option("--layers", type=click.IntRange(min=1), help="The draft's layers. [default: an eighth of the target's]")
@click.option(
    "--hidden",
    type=click.IntRange(min=8),
    help="The draft's width, a multiple of its head size. [default: half the target's]",
)
@click.option(
    "--intermediate",
    type=click.IntRange(min=1),
    help="The draft's MLP width. [default: the target's ratio to its width]",
)
@click.option(
    "--loss",
    type=click.Choice(("fkl", "tvd")),
    default="fkl",
    show_default=True,
    help="The divergence to the target's distributions: forward KL or total variation (docs/draft-train.md "
    "says which and why).",
)
@click.option(
    "--teacher-top-k",
    type=click.IntRange(0, 20),
    default=20,
    show_default=True,
    help="Train on the target's top-k next tokens a position, kept as it decodes (no target forward while "
    "training); 0: on its whole distribution, recomputed by a target forward each step.",
)
@click.option(
    "--learning-rate",
    type=click.FloatRange(min=0, min_open=True),
    help="AdamW's peak step size (warm-up, then decay). [default: 1e-3 for a model, 3e-3 for a head]",
)
@click.option("--train-batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Sequences a step.")
@click.option(
    "--checkpoint-every", type=click.IntRange(min=1), default=50, show_default=True, help="Steps between checkpoints."
)
@click.option(
    "--heldout",
    type=click.IntRange(min=1),
    help="Prompts kept out of training and measured on at the end. [default: a tenth, 1 to 32]",
)
@click.option(
    "--train-seed",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Seed of the split, init and batches.",
)
@click.option(
    "--max-tokens", type=int_range(MAX_TOKENS), default=128, show_default=True, help="The target's completion length."
)
@click.option(
    "--temperature",
    type=float_range(TEMPERATURE),
    default=0.0,
    show_default=True,
    help="The target's sampling temperature while it decodes (a line may set its own), and the measurement's.",
)
@click.option("--top-p", type=float_range(TOP_P), help="Nucleus sampling mass. [default: 1.0]")
@click.option("--top-k", type=int_range(TOP_K), help="Top-k cut, 0 for none. [default: 0]")
@click.option("--seed", type=int_range(SEED), help="Sampling seed of lines that set none.")
@click.option(
    "--batch-size",
    type=int_range(BATCH_SIZE),
    default=32,
    show_default=True,
    help="Rows the target decodes together (SmolLM2-135M on 2 CPU cores: 101 tokens/s at 32 rows, 75 at 8).",
)
@click.option("--device", help="Torch device, e.g. cpu or cuda:0. [default: cuda:0 if available, else cpu]")
@click.option(
    "--dtype",
    type=click.Choice(DTYPES, case_sensitive=False),
    help="The target's dtype, as `run` takes it. [default: auto; the draft trains in float32]",
)
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False),
    help="A Jinja chat template file for chat lines. [default: the target tokenizer's]",
)
@click.option(
    "--num-speculative-tokens",
    "-k",
    type=int_range(BENCH_SPECULATIVE_TOKENS),
    default=4,
    show_default=True,
    help="K of the held-out measurement.",
)
@click.option(
    "--eval-batch-sizes",
    default="1",
    show_default=True,
    callback=_batch_sizes,
    help="Batch sizes of the held-out measurement, comma-separated.",
)
@click.option(
    "--eval-warmup",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Untimed passes before the timed ones.",
)
@click.option(
    "--eval-repeats",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Timed passes of each way of decoding, in turns: the speed-up is the median of the rounds' ratios.",
)
@compile_option(
    "auto",
    "The held-out measurement's compiled forwards, target-only's and the draft's alike (as run and submit "
    "take --compile): its speed-up is then over target-only as you would run it.",
)
@click.option("--progress/--no-progress", default=True, help="Progress bars on stderr. [default: on]")
@input_limit_options
def train(
    target: str,
    data_path: str,
    output_dir: Path,
    overwrite: bool,
    budget: Budget,
    time_limit: timedelta | None,
    proposer: str,
    head_vocab: int,
    layers: int | None,
    hidden: int | None,
    intermediate: int | None,
    loss: str,
    teacher_top_k: int,
    learning_rate: float | None,
    train_batch_size: int,
    checkpoint_every: int,
    heldout: int | None,
    train_seed: int,
    max_tokens: int,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    batch_size: int,
    device: str | None,
    dtype: str | None,
    chat_template: str | None,
    num_speculative_tokens: int,
    eval_batch_sizes: tuple[int, ...],
    eval_warmup: int,
    eval_repeats: int,
    compile: str,
    progress: bool,
    input_limits: InputLimits,
) -> None:
    """Distil a draft for TARGET from its own outputs on PROMPTS.jsonl, into DIR.

    The target decodes the training prompts (target-only, with specq's engine), a small draft sized
    from it learns its distributions, and the command ends by measuring the draft against target-only
    on held-out prompts, as `specq bench` does; DIR alone on stdout. Before the decoding it measures the
    target's speed and prints its plan, an estimate a phase (fitted into --time-limit where given). An
    interrupted run (Ctrl-C, a kill) resumes when the same command is run again. Exit 2 on bad prompts
    (one too long for the target's context among them), a target that does not load, a DIR that exists,
    a DIR in a place it may not be (see -o) or a --time-limit too short for the smallest run.
    """
    from specq.decoding.types import SamplingParams
    from specq.distill.run import train_draft
    from specq.distill.settings import DistillSettings, DraftShape
    from specq.distill.trainer import TrainingInterrupted

    # the sampling options given; those left out take SamplingParams' defaults
    given: dict[str, Any] = {
        name: value for name, value in (("top_p", top_p), ("top_k", top_k), ("seed", seed)) if value is not None
    }
    with specq_errors():
        from specq.jobs.chat_template import load_chat_template

        try:
            settings = DistillSettings(
                target=target,
                data=data_path,
                sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, **given),
                chat_template=None if chat_template is None else load_chat_template(chat_template),
                device=device or None,
                dtype=dtype.lower() if dtype else None,
                decode_batch_size=batch_size,
                budget=budget,
                proposer=proposer,  # type: ignore[arg-type]
                head_vocab=head_vocab,
                shape=DraftShape(layers, hidden, intermediate),
                loss=loss,  # type: ignore[arg-type]
                teacher_top_k=teacher_top_k,
                learning_rate=learning_rate,
                train_batch_size=train_batch_size,
                checkpoint_every=checkpoint_every,
                heldout=heldout,
                seed=train_seed,
                eval_batch_sizes=eval_batch_sizes,
                num_speculative_tokens=num_speculative_tokens,
                eval_warmup=eval_warmup,
                eval_repeats=eval_repeats,
                eval_compile=compile,
            )
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        shown = _Shown(progress, Speaker(lambda line: click.echo(line, err=True)))
        started = time.perf_counter()
        try:
            with shown.watched():
                outcome = train_draft(
                    settings,
                    output_dir,
                    shown,
                    overwrite=overwrite,
                    limits=input_limits,
                    time_limit_s=None if time_limit is None else time_limit.total_seconds(),
                )
        except (TrainingInterrupted, KeyboardInterrupt) as exc:
            shown.close()
            what = str(exc) if isinstance(exc, TrainingInterrupted) else "interrupted"
            click.echo(f"{what}; run the same command again to resume", err=True)
            raise SystemExit(130) from None
        finally:
            shown.close()
    from specq.distill.evaluate import summary_lines, usage_line

    state = outcome.state
    prompts = f"{outcome.train_prompts}" + (
        f" of {outcome.training_prompts_in_file}" if outcome.train_prompts < outcome.training_prompts_in_file else ""
    )
    stopped = f" ({state['stopped']})" if state.get("stopped") else ""
    click.echo(
        f"trained on {prompts} prompts: {state['tokens']} tokens in {state['step']} steps, "
        f"{state['elapsed_s']:.0f}s of training, {state['checkpoints']} checkpoints, final loss {state['loss']:.4f}"
        f"{stopped}; {time.perf_counter() - started:.0f}s in all" + (" (this try)" if outcome.resumed else ""),
        err=True,
    )
    for line in summary_lines(outcome.evaluation):
        click.echo(line, err=True)
    click.echo(usage_line(outcome.evaluation, str(outcome.draft_dir)), err=True)
    click.echo(str(outcome.draft_dir))  # alone on stdout, for scripts: draft=$(specq draft train ...)


class _Shown:
    """The command's progress on stderr: a bar for the target's decoding, one for training (tokens or
    seconds of the budget, with ETA and loss), and lines for the rest. Where none of them came for a while
    (a model's load, a compile, a slow warm-up step), `watched` says what the command is still busy with."""

    def __init__(self, show: bool, speaker: Speaker) -> None:
        self.show = show
        self.speaker = speaker
        self.count_bar: ProgressBar | None = None
        self.count_started = 0.0
        self.train_bar: Any = None
        self._last_line = time.monotonic()
        self._phase, self._phase_started = "reading the data and loading the target", speaker.clock()

    def watched(self) -> AbstractContextManager[None]:
        """The block under the speaker's watch: never silent for more than its `every_s` (with --progress)."""
        return self.speaker.watching(self.busy) if self.show else nullcontext()

    def busy(self) -> str:
        """The watcher's line: what the last line said is under way, and for how long."""
        return f"busy ({self.speaker.clock() - self._phase_started:.0f}s since: {self._phase})"

    def say(self, message: str) -> None:
        self.close()  # a phase's bar ends where the next phase's first line comes
        self.speaker.say(message)
        self._phase, self._phase_started = message, self.speaker.clock()

    def decoding(self, done: int, total: int, stats: EngineStats) -> None:
        self._count("target decodes", done, total, stats.num_generated_tokens, None)  # target alone: no rate

    def reading(self, done: int, total: int, tokens: int) -> None:
        self._count("target reads hidden states", done, total, tokens, None)

    def _count(self, label: str, done: int, total: int, tokens: int, acceptance: float | None) -> None:
        """A phase that counts sequences (the decode, the hidden states' read) on one bar, with its tokens/s."""
        if self.count_bar is None:
            self.count_bar = ProgressBar(label, total, self.show).__enter__()
            self.count_started = time.perf_counter()
        elapsed = max(time.perf_counter() - self.count_started, 1e-9)
        if self.count_bar.update(done, tokens / elapsed, acceptance) or not self.count_bar.plain:
            self.speaker.spoke()  # a plain line, or a live bar that just moved
        if done == total:
            self.count_bar.__exit__()
            self.count_bar = None

    def training(self, state: TrainState, budget: Budget) -> None:
        total, done = (
            (float(budget.tokens), float(state.tokens))
            if budget.tokens is not None
            else (float(budget.seconds or 0.0), state.elapsed_s)
        )
        if self.train_bar is None:
            self.train_bar = _training_bar(self.show)
            self.train_task = self.train_bar.add_task("training", total=total, loss=state.loss, step=state.step)
            self.plain = self.show and not self.train_bar.console.is_terminal
            self.train_bar.__enter__()
        self.train_bar.update(self.train_task, completed=min(done, total), loss=state.loss, step=state.step)
        if not self.plain:
            self.speaker.spoke()  # the live bar just moved
        now = time.monotonic()
        if self.plain and now - self._last_line >= PLAIN_EVERY_S:
            self._last_line = now
            share = f"{state.fraction(budget):.0%} of {budget.describe()}"
            sys.stderr.write(f"training: step {state.step}, {share}, loss {state.loss:.4f}\n")
            sys.stderr.flush()
            self.speaker.spoke()

    def close(self) -> None:
        if self.count_bar is not None:
            self.count_bar.__exit__()
            self.count_bar = None
        if self.train_bar is not None:
            self.train_bar.__exit__(None, None, None)
            self.train_bar = None


def _training_bar(show: bool) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    console = Console(stderr=True)
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
        TextColumn("step {task.fields[step]}"),
        TextColumn("loss {task.fields[loss]:.4f}"),
        console=console,
        disable=not show or not console.is_terminal,
    )
