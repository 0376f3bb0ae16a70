"""`specq draft train`: the plan (distill/plan.py), then the three phases in order, each picked up where an
earlier try left it, and all of them within `--time-limit` where one is given."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from specq.budget import Budget
from specq.distill.settings import DistillSettings
from specq.errors import BadInputError, TimeLimitError

if TYPE_CHECKING:
    from specq.decoding.stats import EngineStats
    from specq.distill.trainer import TrainState
    from specq.jobs.inputs import InputLimits

log = logging.getLogger(__name__)


class Progress(Protocol):
    """What the command shows while it works (cli/draft.py draws it)."""

    def say(self, message: str) -> None: ...  # a line on stderr

    def decoding(self, done: int, total: int, stats: EngineStats) -> None: ...

    def reading(self, done: int, total: int, tokens: int) -> None: ...  # sequences the target read; tokens this try

    def training(self, state: TrainState, budget: Budget) -> None: ...


@dataclass(frozen=True)
class Outcome:
    draft_dir: Path
    resumed: bool
    train_prompts: int  # the training sequences the draft learnt from
    heldout_prompts: int
    state: dict[str, Any]  # the last TrainState, as a dict (`stopped` where --time-limit ended training)
    evaluation: dict[str, Any]  # evaluate.evaluate_draft's report
    training_prompts_in_file: int = 0  # the file's prompts not held out: more than `train_prompts` where a limit cut


def train_draft(
    settings: DistillSettings,
    output: Path,
    progress: Progress,
    *,
    overwrite: bool = False,
    limits: InputLimits | None = None,
    time_limit_s: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Outcome:
    """Validate the prompts, measure the target and say the plan (distill/plan.py), then decode, train and
    evaluate into `output` (distill/workdir.py). `time_limit_s`: the whole call's bound on `clock`, from
    its start (this try's alone, where it resumes an earlier one); the plan fits the phases into it."""
    started = clock()
    from specq.decoding.hf_model import context_length
    from specq.distill.corpus import (
        DecodeStore,
        check_within_context,
        decode_with_target,
        load_sequences,
        prepare_prompts,
        save_sequences,
        split,
    )
    from specq.distill.evaluate import evaluate_draft
    from specq.distill.workdir import check_output_place, file_digest, open_workdir
    from specq.jobs.chat_template import ChatLines
    from specq.jobs.input_source import readable_input
    from specq.jobs.inputs import iter_request_specs, validate_file
    from specq.models.loading import check_supported, load_config, load_tokenizer

    # where DIR may not go is known from the command line alone: refused before anything is read or written
    check_output_place(output, settings.target, None if settings.data == "-" else settings.data)
    with readable_input(settings.data, limits) as source, ExitStack() as cleanup:
        # the target's tokenizer and config first: a missing target costs seconds, and nothing is written
        tokenizer = load_tokenizer(settings.target)
        config = load_config(settings.target)
        check_supported(settings.target, config)
        # chat lines rendered as `submit` renders them (jobs/chat_render.py: bounded, in a child process)
        chat_lines = cleanup.enter_context(ChatLines(settings.target, settings.chat_template, lambda _: tokenizer))
        total = validate_file(source.path, limits, name=source.name, prepare=chat_lines)
        if total < 2:
            raise BadInputError([f"{source.name}: {total} prompts; at least 2 are needed, one of them held out"])
        specs = iter_request_specs(source.path, limits, name=source.name, prepare=chat_lines)
        prompts = prepare_prompts(specs, tokenizer, settings.sampling, source.name)
        check_within_context(prompts, context_length(config.get_text_config()), source.name)
        digest = file_digest(source.path)

    train_ids, heldout_ids = split(len(prompts), settings.heldout_count(len(prompts)), settings.seed)
    train_prompts = [prompts[i] for i in train_ids]
    with open_workdir(output, settings.identity(), digest, overwrite) as workdir:
        if workdir.resumed:
            progress.say(f"resuming the unfinished run in {output} (phase: {workdir.phase})")
        target, plan, sequences = None, None, None
        if workdir.phase in ("decode", "train"):
            from specq.distill.plan import decode_order, make_plan, measure_target_speed, plan_lines
            from specq.models.loading import load_model, resolve_device

            # on the device and dtype the run decodes with, also where a resumed run only sizes its draft
            # from the target: the probe measures the target as the phases left will run it
            reads = settings.proposer == "head" and not workdir.hidden_states.exists()  # a head's, this try
            loading = clock()
            target = load_model(settings.target, resolve_device(settings.device), settings.dtype)
            order = decode_order(len(train_prompts), settings.seed)
            speed = measure_target_speed(
                target,
                tokenizer,
                [train_prompts[i] for i in order[: settings.decode_batch_size]],
                settings.decode_batch_size,
                settings.teacher_top_k,
                clock,
                load_s=clock() - loading,
                reads=reads,
            )
            store = DecodeStore(workdir.decoding) if workdir.phase == "decode" else None
            if store is None:
                sequences = load_sequences(workdir.sequences)
            done = list(store.decoded.values()) if store is not None else sequences or []
            try:
                plan = make_plan(
                    speed,
                    settings,
                    [] if store is None else [(i, train_prompts[i]) for i in order if i not in store.decoded],
                    [len(sequence.token_ids) for sequence in done],
                    reads,
                    [prompts[i] for i in heldout_ids],
                    clock() - started,
                    time_limit_s,
                )
            except TimeLimitError:
                if not workdir.resumed:  # refused before its work: DIR is left as the command found it
                    workdir.discard()
                raise
            for line in plan_lines(plan, settings, len(heldout_ids)):
                progress.say(line)
        if workdir.phase == "decode":
            assert target is not None and plan is not None and store is not None
            stored = len(store.decoded)
            progress.say(
                f"the target decodes {len(plan.decode)} training prompts ({len(heldout_ids)} held out"
                + (f"; {stored} decoded by an earlier try)" if stored else ")")
            )
            decode_until = plan.decode_until_s
            sequences = decode_with_target(
                target,
                tokenizer,
                train_prompts,
                settings.decode_batch_size,
                top_k=settings.teacher_top_k,
                on_progress=progress.decoding,
                store=store,
                wanted={*store.decoded, *plan.decode},
                stop=(lambda: False) if decode_until is None else (lambda: clock() - started >= decode_until),
            )
            save_sequences(workdir.sequences, sequences)
            workdir.advance("train", train_prompts=len(sequences), heldout_prompts=len(heldout_ids))
            workdir.decoding.unlink(missing_ok=True)  # sequences.jsonl holds it all now
        if workdir.phase == "train":
            assert target is not None and plan is not None and sequences is not None
            train = _train_head if settings.proposer == "head" else _train
            stop_at = None if plan.train_until_s is None else started + plan.train_until_s
            state = train(settings, target, tokenizer, workdir, sequences, progress, clock, stop_at)
            del target
            workdir.advance("evaluate", training=state)
        progress.say(f"measuring the draft against target-only on {len(heldout_ids)} held-out prompts")
        evaluation = evaluate_draft(
            settings, str(output), [prompts[i].request.prompt_token_ids for i in heldout_ids], progress.say
        )
        workdir.advance("done", evaluation=evaluation)
        workdir.remove_work_files()
        return Outcome(
            output,
            workdir.resumed,
            int(workdir.run.get("train_prompts", len(train_ids))),
            len(heldout_ids),
            workdir.run["training"],
            evaluation,
            len(train_ids),
        )


def _stopped(state: TrainState, budget: Budget) -> str:
    """Why training ended before its budget was spent: the whole command's limit."""
    spent = f"{state.tokens} tokens" if budget.tokens is not None else f"{state.elapsed_s:.0f}s"
    return f"--time-limit stopped it at {spent} of {budget.describe()}"


def _train(
    settings: DistillSettings,
    target: Any,
    tokenizer: Any,
    workdir: Any,
    sequences: list,
    progress: Progress,
    clock: Callable[[], float],
    stop_at: float | None,
) -> dict[str, Any]:
    from specq.distill.sizing import build_draft
    from specq.distill.trainer import StoredTeacher, Teacher, Trainer
    from specq.models.loading import resolve_device

    target.eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    draft = build_draft(target, settings.shape, settings.seed).to(resolve_device(settings.device))
    teacher = StoredTeacher() if settings.teacher_top_k else Teacher(target)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    trainer = Trainer(
        draft,
        teacher,
        sequences,
        settings.budget,
        loss=settings.loss,
        learning_rate=settings.peak_learning_rate,
        batch_size=settings.train_batch_size,
        max_tokens=settings.max_train_tokens,
        checkpoint_every=settings.checkpoint_every,
        seed=settings.seed,
        pad_id=int(pad),
    )
    config = draft.config
    if trainer.restore(workdir.work):
        progress.say(f"continuing from the checkpoint at step {trainer.state.step}")
    progress.say(
        f"training a {config.num_hidden_layers}-layer, {config.hidden_size}-wide draft "
        f"({sum(p.numel() for p in draft.parameters()):,} parameters) on {len(sequences)} sequences "
        f"for {settings.budget.describe()} ({settings.loss})"
    )
    state = trainer.run(
        workdir.work, on_step=lambda state: progress.training(state, settings.budget), clock=clock, stop_at=stop_at
    )
    draft.eval()
    from transformers.utils import logging as hf_logging

    # transformers' own bar while it writes the weights would interleave with the command's lines
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        draft.save_pretrained(workdir.root)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(workdir.root)
    return dict(vars(state)) if trainer.done() else {**vars(state), "stopped": _stopped(state, settings.budget)}


def _train_head(
    settings: DistillSettings,
    target: Any,
    tokenizer: Any,
    workdir: Any,
    sequences: list,
    progress: Progress,
    clock: Callable[[], float],
    stop_at: float | None,
) -> dict[str, Any]:
    """A draft head (distill/head.py) trained on the stored completions, saved into DIR with the target's
    tokenizer; the target's hidden states are read once into the work folder, and training checkpoints and
    resumes as the draft model's does."""
    import torch

    from specq.distill.head import HeadTrainer, coverage, load_chains, new_head, read_chains

    target.eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    torch.manual_seed(settings.seed)
    head = new_head(target, sequences, settings.head_vocab, settings.head_intermediate)
    covered = coverage(sequences, head.vocab_ids)
    progress.say(
        f"a draft head ({sum(p.numel() for p in head.parameters() if p.requires_grad):,} parameters, "
        f"{head.config.vocab_rows} of {head.target_vocab_size} tokens: {covered:.1%} of the completions' tokens)"
    )
    stored = load_chains(workdir.hidden_states)
    if stored is None:  # parts an earlier try read are not read again
        progress.say(f"the target reads {len(sequences)} sequences for its hidden states")
        chains, read_s = read_chains(target, sequences, workdir.hidden_states, progress.reading, clock)
        progress.say(f"read {chains.tokens.numel():,} hidden states in {read_s:.0f}s")
    else:
        chains, read_s = stored
        progress.say(f"the {chains.tokens.numel():,} hidden states an earlier try read")
    trainer = HeadTrainer(
        head,
        chains,
        settings.budget,
        depth=settings.num_speculative_tokens,
        learning_rate=settings.peak_learning_rate,
        seed=settings.seed,
        elapsed_s=read_s,  # the target's forward is the head's cost: it counts in a time budget
        checkpoint_every=settings.checkpoint_every,
    )
    if trainer.restore(workdir.work):
        progress.say(f"continuing from the checkpoint at step {trainer.state.step}")
    progress.say(f"training for {settings.budget.describe()}")
    state = trainer.run(
        workdir.work, on_step=lambda state: progress.training(state, settings.budget), clock=clock, stop_at=stop_at
    )
    head.eval()
    head.save(workdir.root)
    tokenizer.save_pretrained(workdir.root)
    stopped = {} if trainer.done() else {"stopped": _stopped(state, settings.budget)}
    return {**vars(state), "head_vocab_coverage": covered, "hidden_states_s": read_s, **stopped}
