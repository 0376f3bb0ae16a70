"""The plan of a `specq draft train` run, printed before its first heavy phase: the target's speed,
measured by a probe of a few seconds, an estimate of each phase from it and, under `--time-limit`, how
the phases fit the whole command into the limit.

The probe (`measure_target_speed`) decodes the first training prompts (in `decode_order`) at the
decode's rows, then the first of them at one row, each twice: one token (the prefill alone), then
1 + PROBE_STEPS tokens, so that a decode step's cost and a prefill's come apart. A forward costs a
step's time at its rows (a small model's forward is mostly overhead), and a prefill besides that a
marginal cost a prompt token. The probe runs on the command's clock, as every phase's bound does, and
its completions, cut short, are not kept. The estimates (`TargetSpeed`):

    decode         a forward for each prompt's prefill and its prompt tokens, then the completions'
                   tokens `rows` at a time (continuous batching keeps the rows full), a step at the
                   cost measured at that many rows;
    hidden states  a head's one target forward over each sequence, one at a time (timed apart: a plain
                   forward without the engine's cache costs more than a decode step);
    training       --budget's time where it is one; a token budget's time is unknown before it starts;
    measurement    `specq bench`'s passes over the held-out prompts (evaluate.py: warm-up and timed,
                   target-only and the three ways with the draft), each a decode at the measurement's
                   batch size, and the models' load again (its compile, where --compile compiles, is
                   not counted).

Completions count at their `max_tokens` (a completion that ends at EOS is shorter), so the estimates
lean long, as a bound wants. Under a limit the plan keeps LIMIT_SPARE of it unspent, reserves the
measurement's estimate, and gives the rest to the data (the decode and a head's read of the hidden
states) and to training: all the prompts and all of --budget where both fit, else the data at least
DATA_SHARE of it (fewer prompts decoded: the first of `decode_order`, a seeded sample of the file) and
training what the data leaves, never more than --budget. A decode running late stops where its share,
what the others left over and LATE_DECODE_SHARE of training's end, training where the measurement's
reserve begins; the measurement itself is not cut. A limit that leaves less than one prompt's decode
and MIN_TRAINING_S of training beside the measurement is refused (TimeLimitError) before the decode.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from specq.distill.corpus import Prompt
from specq.distill.settings import DistillSettings
from specq.errors import SpecqError, TimeLimitError

Clock = Callable[[], float]

PROBE_STEPS = 8  # decode steps the probe times at each row count: a step's mean, in seconds on a small CPU
# A pass with the draft against a target-only pass: a well trained draft makes it faster (a head's 1.77x
# at batch 1 on SmolLM2, docs/draft-train.md), a poor one slower (a verify of K + 1 tokens costs about a
# step and a half). The tiny test target's head after 30 s: 0.63x (K adaptive), 2.2x (K fixed), 1.1x
# (the hybrid), 1.3x on average; a run short of time trains such a draft, and its measurement is not cut
SPEC_PASS_COST = 1.3
MIN_TRAINING_S = 10.0  # the least training a run under --time-limit gets: hundreds of a head's steps on a CPU
LIMIT_SPARE = 0.05  # the share of --time-limit the plan leaves unspent: its estimates come from a probe of seconds
# The share of training's time that a decode running past its estimate may take before it stops: its
# completions under way are half paid for, and training is the phase that ends anywhere
LATE_DECODE_SHARE = 0.5
# Where the data and training both want more than the limit leaves, the data's share: no measurement
# here says whether more prompts or more steps make the better draft in a short run, so an even split
DATA_SHARE = 0.5


def decode_order(count: int, seed: int) -> list[int]:
    """The training prompts' positions in the order a run cut short by --time-limit takes them: a seeded
    shuffle, so that the prompts it decodes are a sample of the file rather than its first lines, and a
    try with more time left decodes further along the same order."""
    return random.Random(seed).sample(range(count), count)


def span(seconds: float) -> str:
    """A duration as the plan prints it: 45s, 3m20s, 1h05m."""
    whole = max(0, math.ceil(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


@dataclass(frozen=True)
class TargetSpeed:
    """The target's costs on the command's clock, as `measure_target_speed` measured them. A forward costs
    what a decode step at its rows costs (a small model's step is mostly overhead), and a prefill besides
    that its prompt tokens at a marginal cost a token."""

    rows: int  # the decode's rows, measured (its batch size, or fewer prompts)
    token_s_at_rows: float  # a prefill's marginal cost a prompt token, prefilling `rows` prompts
    token_s_one_row: float  # ... prefilling one
    step_s_at_rows: float  # a decode step of `rows` rows
    step_s_one_row: float
    load_s: float  # the target's load
    # a head's read of one sequence's hidden states (a plain forward, no cache), its tokens' marginal cost
    # aside; where no read was timed, a one-row step's
    read_forward_s: float | None = None

    def step_s(self, rows: int) -> float:
        """A decode step of `rows` rows: linear between (and past) the two measured."""
        if self.rows <= 1 or rows <= 1:
            return self.step_s_one_row
        slope = max(0.0, (self.step_s_at_rows - self.step_s_one_row) / (self.rows - 1))
        return self.step_s_one_row + slope * (rows - 1)

    def tokens_per_s(self, rows: int) -> float | None:
        step = self.step_s(rows)
        return rows / step if step > 0 else None

    def decode_s(self, prompt_tokens: Sequence[int], completion_tokens: Sequence[int], rows: int) -> float:
        """Prompts of `prompt_tokens` tokens each completed by `completion_tokens`, `rows` at a time."""
        if not prompt_tokens:
            return 0.0
        return _decode_s(
            self, sum(prompt_tokens), sum(completion_tokens), max(completion_tokens), len(prompt_tokens), rows
        )

    def read_s(self, sequence_tokens: Sequence[int]) -> float:
        """A head's read of the hidden states: one forward over each sequence, one at a time."""
        forward_s = self.step_s_one_row if self.read_forward_s is None else self.read_forward_s
        return len(sequence_tokens) * forward_s + self.token_s_one_row * sum(sequence_tokens)


def _decode_s(
    speed: TargetSpeed, prompt_tokens: int, completion_tokens: int, longest: int, count: int, rows: int
) -> float:
    """`count` prompts of `prompt_tokens` tokens in all, completed by `completion_tokens` (the longest
    `longest`), `rows` at a time: a forward each prompt's prefill (a refill may prefill several rows in one:
    the estimate leans long), then the tokens after each completion's first (the prefill's) `rows` a step."""
    rows = max(1, min(rows, count))
    per_token = speed.token_s_one_row if rows == 1 else speed.token_s_at_rows
    prefills = count * speed.step_s_one_row + per_token * prompt_tokens
    steps = max((completion_tokens - count) / rows, longest - 1)  # the longest completion's steps at least
    return prefills + steps * speed.step_s(rows)


def measure_target_speed(
    target: Any,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    rows: int,
    top_k: int,
    clock: Clock,
    load_s: float,
    reads: bool = False,
) -> TargetSpeed:
    """The probe (the module's docstring): the first `rows` of `prompts` decoded a few tokens at once,
    then the first alone, timed on `clock`; their completions are not kept (they are cut short). With
    `reads`, a head's read of the hidden states of the first prompt and its probe completion too."""
    from specq.decoding.config import DecodingConfig
    from specq.decoding.engine import SpeculativeEngine
    from specq.decoding.types import GenerationRequest

    batch = list(prompts[: max(1, rows)])
    engine = SpeculativeEngine(target, tokenizer, None, DecodingConfig(batch_size=len(batch)))
    completions: dict[int, tuple[int, ...]] = {}  # the last run's, by position in `chosen`

    def timed(chosen: list[Prompt], tokens: int) -> tuple[float, int]:
        """Seconds on `clock` to decode `chosen` `tokens` tokens each (fewer where a line allows fewer), and steps."""
        requests = [
            GenerationRequest(
                i,
                prompt.request.prompt_token_ids,
                replace(
                    prompt.request.params,
                    max_tokens=min(tokens, prompt.request.params.max_tokens),
                    logprobs=top_k or None,
                ),
            )
            for i, prompt in enumerate(chosen)
        ]
        engine.reset_stats()
        completions.clear()
        started = clock()
        for result in engine.generate(requests):
            if result.error is not None:
                raise SpecqError(f"the target failed on line {chosen[result.key].line}: {result.error}")
            completions[result.key] = tuple(result.token_ids)
        return clock() - started, engine.stats.num_steps

    def costs(chosen: list[Prompt]) -> tuple[float, float]:
        """(a prefill's marginal cost a prompt token, a step's cost) at `chosen`'s rows."""
        prefill_s, _ = timed(chosen, 1)
        whole_s, steps = timed(chosen, 1 + PROBE_STEPS)
        step_s = max(0.0, whole_s - prefill_s) / steps if steps else prefill_s
        prompt_tokens = sum(len(prompt.request.prompt_token_ids) for prompt in chosen)
        return max(0.0, prefill_s - step_s) / max(1, prompt_tokens), step_s

    timed(batch[:1], 2)  # a first forward's one-off costs (allocations, kernels chosen) stay out of the times
    token_at_rows, step_at_rows = costs(batch)
    token_one_row, step_one_row = costs(batch[:1])  # the last run: its completion is the read's below
    read_forward_s = None
    if reads and completions.get(0):  # (a completion the target ended at once gives no forward to time)
        import torch

        # the forward distill/head.py's `target_states` runs over each sequence, without the engine's cache
        tokens = (*batch[0].request.prompt_token_ids, *completions[0])
        ids = torch.tensor([tokens], device=next(target.parameters()).device)
        reads_s = []
        with torch.inference_mode():
            for _ in range(2):  # the first forward of the path carries its one-off costs: the faster of two
                started = clock()
                target.base_model(input_ids=ids)
                if ids.is_cuda:  # the forward's kernels run on after it returns; the read waits for them
                    torch.cuda.synchronize(ids.device)
                reads_s.append(clock() - started)
        read_forward_s = max(0.0, min(reads_s) - token_one_row * len(tokens))
    return TargetSpeed(len(batch), token_at_rows, token_one_row, step_at_rows, step_one_row, load_s, read_forward_s)


def evaluation_s(speed: TargetSpeed, settings: DistillSettings, heldout: Sequence[Prompt]) -> float:
    """The held-out measurement (evaluate.py): the models' load, then at each batch size its warm-up and
    timed passes of target-only and of the three ways with the draft (K adaptive, K fixed, the hybrid)."""
    from specq.bench.runner import SPECQ_RUNS

    prompt_tokens = [len(prompt.request.prompt_token_ids) for prompt in heldout]
    completions = [settings.sampling.max_tokens] * len(heldout)  # the measurement's own, for every line
    with_draft = len(SPECQ_RUNS) - 1 + 1  # the runs but target-only, and the hybrid
    pass_cost = 1 + with_draft * SPEC_PASS_COST
    passes = settings.eval_warmup + settings.eval_repeats
    decodes = sum(speed.decode_s(prompt_tokens, completions, size) for size in settings.eval_batch_sizes)
    return speed.load_s + passes * pass_cost * decodes


@dataclass(frozen=True)
class Plan:
    """What this try does and how long each phase should take, in seconds on the command's clock; the
    deadlines count from the command's start."""

    speed: TargetSpeed
    pending: int  # training prompts not decoded yet
    stored: int  # training sequences decoded by an earlier try
    decode: list[int]  # the positions among the training prompts this try decodes (file order)
    decode_s: float
    read_s: float | None  # a head's read of the hidden states; None: none this try
    training_s: float | None  # None: unknown (a token budget, no limit)
    training_cut: bool  # --time-limit gives training less than --budget asks (or bounds a token budget)
    evaluation_s: float
    elapsed_s: float  # before the plan: reading the prompts, loading the target, the probe
    limit_s: float | None
    decode_until_s: float | None  # where the decode stops, done or not
    train_until_s: float | None  # where training stops, its budget spent or not

    @property
    def total_s(self) -> float | None:
        if self.training_s is None:
            return None
        return self.elapsed_s + self.decode_s + (self.read_s or 0.0) + self.training_s + self.evaluation_s


def make_plan(
    speed: TargetSpeed,
    settings: DistillSettings,
    pending: Sequence[tuple[int, Prompt]],
    stored_tokens: Sequence[int],
    reads: bool,
    heldout: Sequence[Prompt],
    elapsed_s: float,
    limit_s: float | None,
) -> Plan:
    """The plan of a try: `pending` the training prompts not decoded yet (position, prompt) in
    `decode_order`, `stored_tokens` the token counts of the sequences an earlier try decoded, `reads`
    whether a head's hidden states are read this try; `elapsed_s` already spent of `limit_s`.
    TimeLimitError where the limit cannot fit a minimal run (the module's docstring)."""
    budget = settings.budget
    head = settings.proposer == "head"
    rows = settings.decode_batch_size
    evaluation = evaluation_s(speed, settings, heldout)
    stored_read = speed.read_s(stored_tokens) if reads else 0.0
    # the data's time for the first n pending prompts, n = 0 .. len(pending): decode and read
    data, decodes, read_new = [stored_read], [0.0], [0.0]
    prompt_tokens = completion_tokens = longest = 0
    for count, (_, prompt) in enumerate(pending, 1):
        prompt_length, completion = len(prompt.request.prompt_token_ids), prompt.request.params.max_tokens
        prompt_tokens, completion_tokens = prompt_tokens + prompt_length, completion_tokens + completion
        longest = max(longest, completion)
        decodes.append(_decode_s(speed, prompt_tokens, completion_tokens, longest, count, rows))
        read_new.append(read_new[-1] + (speed.read_s([prompt_length + completion]) if reads else 0.0))
        data.append(decodes[-1] + stored_read + read_new[-1])

    def training_wanted(n: int) -> float:
        if budget.seconds is None:
            return math.inf
        # a head's time budget counts the target's read of its hidden states
        return max(0.0, budget.seconds - (data[n] - decodes[n] if head and reads else 0.0))

    def planned(count: int, training: float | None, decode_until: float | None, train_until: float | None) -> Plan:
        return Plan(
            speed=speed,
            pending=len(pending),
            stored=len(stored_tokens),
            decode=sorted(i for i, _ in pending[:count]),
            decode_s=decodes[count],
            read_s=data[count] - decodes[count] if reads else None,
            training_s=training,
            training_cut=training is not None and training < training_wanted(count),
            evaluation_s=evaluation,
            elapsed_s=elapsed_s,
            limit_s=limit_s,
            decode_until_s=decode_until,
            train_until_s=train_until,
        )

    count = len(pending)
    if limit_s is None:
        wanted = training_wanted(count)
        return planned(count, None if math.isinf(wanted) else wanted, None, None)
    left = limit_s * (1 - LIMIT_SPARE) - elapsed_s - evaluation  # for the data and training
    if data[count] + training_wanted(count) > left:  # not all of it fits: fewer prompts, less training
        count = max(
            (
                n
                for n in range(len(pending) + 1)
                if data[n] <= max(DATA_SHARE * left, left - training_wanted(n)) and data[n] <= left - MIN_TRAINING_S
            ),
            default=-1,
        )
    if count < 0 or len(stored_tokens) + count < 1:
        fewest = 0 if stored_tokens else 1  # prompts a minimal run decodes
        least_training = min(MIN_TRAINING_S, training_wanted(fewest))
        needed = (elapsed_s + evaluation + data[fewest] + least_training) / (1 - LIMIT_SPARE)
        first = f", ~{span(data[1])} for one training prompt's decode" if fewest else ""
        raise TimeLimitError(
            f"--time-limit {span(limit_s)} cannot fit even a minimal run: {span(elapsed_s)} spent loading and "
            f"measuring the target{first}, {span(least_training)} of training and ~{span(evaluation)} for the "
            f"held-out measurement; give at least {span(needed)}"
        )
    training = min(training_wanted(count), left - data[count])
    train_until = limit_s * (1 - LIMIT_SPARE) - evaluation
    # a decode running late may take what the others leave over and part of training's share
    decode_until = train_until - (1 - LATE_DECODE_SHARE) * training - (data[count] - decodes[count])
    return planned(count, training, decode_until, train_until)


def plan_lines(plan: Plan, settings: DistillSettings, heldout: int) -> list[str]:
    """The plan as the command prints it: a heading, then a line per phase and the total."""
    speed, budget = plan.speed, settings.budget
    rates = [(rows, speed.tokens_per_s(rows)) for rows in sorted({speed.rows, 1}, reverse=True)]
    measured = ", ".join(f"{rate:.1f} tokens/s at {rows} row{'s' if rows > 1 else ''}" for rows, rate in rates if rate)
    lines = [f"plan ({span(plan.elapsed_s)} so far, loading and measuring the target: {measured or 'no step timed'}):"]
    earlier = f"; {plan.stored} decoded by an earlier try" if plan.stored else ""
    if len(plan.decode) < plan.pending:
        what = f"{len(plan.decode)} of {plan.pending} training prompts (a seeded sample{earlier}: all would not fit)"
        lines.append(f"  decode: the target completes {what} ~{span(plan.decode_s)}")
    elif plan.pending:
        what = f"{plan.pending} training prompts ({settings.decode_batch_size} rows at a time{earlier})"
        lines.append(f"  decode: the target completes {what} ~{span(plan.decode_s)}")
    else:
        lines.append(f"  decode: done ({plan.stored} training sequences decoded by an earlier try)")
    if settings.proposer == "head":
        if plan.read_s is None:
            lines.append("  hidden states: read by an earlier try")
        else:
            counted = " (counted in --budget's time)" if budget.seconds is not None else ""
            sequences = plan.stored + len(plan.decode)
            lines.append(f"  hidden states: the target reads {sequences} sequences ~{span(plan.read_s)}{counted}")
    less_read = ", less the hidden states' read" if settings.proposer == "head" and plan.read_s is not None else ""
    if plan.training_s is None:
        lines.append(f"  training: {budget.describe()} (--budget; its time is not known before it starts)")
    elif budget.seconds is None:
        ends = f"~{span(plan.training_s)}, whichever ends first (--time-limit)"
        lines.append(f"  training: {budget.describe()} or {ends}")
    elif plan.training_cut:
        lines.append(f"  training: ~{span(plan.training_s)} of --budget {budget.describe()}{less_read} (--time-limit)")
    else:
        lines.append(f"  training: ~{span(plan.training_s)} (--budget {budget.describe()}{less_read})")
    sizes = ",".join(map(str, settings.eval_batch_sizes))
    lines.append(f"  held-out measurement: {heldout} prompts at batch {sizes} ~{span(plan.evaluation_s)}")
    total = plan.total_s
    bound = f" of --time-limit {span(plan.limit_s)}" if plan.limit_s is not None else ""
    if total is None:
        known = plan.elapsed_s + plan.decode_s + (plan.read_s or 0.0) + plan.evaluation_s
        lines.append(f"  total: ~{span(known)} and the training{bound}")
    else:
        lines.append(f"  total: ~{span(total)}{bound}")
    return lines
