"""A draft head trained in place, for a job that pays for its own draft (`submit --draft train:N`):
the head of `specq draft train --proposer head`, on completions a job already has, with the target a
worker already holds, in memory and in one go.

What `draft train` adds around the same trainer (a work folder, checkpoints, resuming, held-out
measurement) is left out: the job measures the head as it speculates with it (and, before, checks its
first proposals on the chains it trained on: `first_token_agreement`), and a worker that dies while
training costs the training's time, which the next worker spends again. The whole phase, the hidden
states' read included, ends by its budget in wall time (`wall_time_limit`), whatever the data. Plain
torch: the worker (worker/trained_draft.py) gathers the completions, judges and stores the head.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from specq.budget import Budget
from specq.decoding.draft_head import DraftHead, HeadConfig
from specq.distill.corpus import Decoded
from specq.distill.head import STORED_STATES_DTYPE, Chains, HeadTrainer, new_head, target_states
from specq.distill.settings import HEAD_LEARNING_RATE, HEAD_VOCAB, TEACHER_TOP_K
from specq.distill.trainer import TrainState

_TEACHER_ROWS = 512  # positions a time through the LM head: [512, vocab] logits, 100 MB for 49k tokens
# A token budget's wall-time bound: its tokens at this rate, a twelfth of what training ran at on a whole
# idle 2-core CPU (SmolLM2-135M, 200k chain tokens in 32 s, docs/draft-train.md), so a budget far beyond
# its data (20k chain tokens on 12 tokens of completions) or a loaded machine still ends the phase
SLOWEST_TOKENS_PER_S = 500.0
LEAST_TOKEN_BUDGET_S = 60.0  # ... and never below this: the hidden states' read counts in it
MEASURED_STARTS = 1024  # chain starts the head's first proposals are checked on: a few steps' worth
# Below this share of first proposals accepted on the very chains it trained on (an optimistic
# measure: no data is held out), a head costs a draft step a verify and saves next to none
USEFUL_AGREEMENT = 0.05


class _BudgetSpent(Exception):
    """The training phase's wall time ran out while the target read the hidden states."""


@dataclass(frozen=True)
class TrainedHead:
    head: DraftHead
    # sequences, chain tokens, steps, seconds, the last steps' loss, the share of its first proposals the
    # target's own tokens match on its chains (`agreement`, where it took a step), and `stopped`: why it
    # ended where the budget was not the reason
    report: dict[str, Any]


def wall_time_limit(budget: Budget) -> float:
    """The most seconds a job's training phase takes, reading the hidden states included: a time budget's
    own, a token budget's at SLOWEST_TOKENS_PER_S (at least LEAST_TOKEN_BUDGET_S)."""
    if budget.seconds is not None:
        return budget.seconds
    assert budget.tokens is not None
    return max(LEAST_TOKEN_BUDGET_S, budget.tokens / SLOWEST_TOKENS_PER_S)


def train_job_head(
    target: Any,
    sequences: Sequence[Decoded],
    budget: Budget,
    depth: int,
    seed: int = 0,
    on_step: Callable[[TrainState], None] = lambda state: None,
    clock: Callable[[], float] = time.perf_counter,
    on_read: Callable[[int], None] = lambda done: None,
) -> TrainedHead:
    """A head for `target` trained on `sequences` (prompt and completion token ids) until `budget` is
    spent: the target reads their hidden states once, then chains of `depth` steps train as in
    distill/head.py. The whole phase ends by `wall_time_limit(budget)` on `clock`, whatever the data: a
    phase that ran out before its first step returns the untrained head with `steps` 0. `on_read` after
    each sequence the target read, `on_step` after each step; an exception from either stops training and
    goes up. ValueError where no sequence has a
    completion two tokens long."""
    started = clock()
    limit = wall_time_limit(budget)
    torch.manual_seed(seed)
    head = new_head(target, sequences, HEAD_VOCAB, None)
    try:
        states = target_states(
            target, sequences, on_sequence=lambda done: _read_one(done, on_read, clock, started, limit)
        )
    except _BudgetSpent:
        read_s = clock() - started
        cut = f"its {limit:g}s ran out while the target read the hidden states"
        return TrainedHead(head.eval(), _report(sequences, None, [], read_s, read_s, cut))
    chains = with_teacher(target, states)
    # rounded as `draft train` stores them: half of fp32's memory, and the same training
    chains = replace(chains, states=chains.states.to(STORED_STATES_DTYPE))
    read_s = clock() - started
    trainer = HeadTrainer(
        head, chains, budget, depth=depth, learning_rate=HEAD_LEARNING_RATE, seed=seed, elapsed_s=read_s
    )
    losses: list[float] = []
    # its own loop, not the trainer's `run`: that checkpoints to a folder every few steps (the head and
    # its optimizer, tens of MB each time), which a job that trains again from the start has no use for
    with torch.enable_grad():
        while not trainer.done() and trainer.state.elapsed_s < limit:
            losses.append(trainer.step())
            trainer.state.elapsed_s = clock() - started
            on_step(trainer.state)
    head.eval()
    stopped: str | None = None
    if trainer.state.step == 0:
        stopped = f"its {limit:g}s ran out before a training step (the hidden states took {read_s:.2f}s)"
    elif not trainer.done():
        stopped = f"its {limit:g}s of wall time ran out after {trainer.state.tokens} of {budget.describe()}"
    report = _report(sequences, trainer.state, losses, read_s, clock() - started, stopped)
    if trainer.state.tokens:
        report["agreement"] = round(first_token_agreement(head, chains), 4)
    return TrainedHead(head, report)


def _read_one(
    done: int, on_read: Callable[[int], None], clock: Callable[[], float], started: float, limit: float
) -> None:
    on_read(done)
    _within(clock, started, limit)


def _within(clock: Callable[[], float], started: float, limit: float) -> None:
    if clock() - started >= limit:
        raise _BudgetSpent


def _report(
    sequences: Sequence[Decoded],
    state: TrainState | None,
    losses: list[float],
    read_s: float,
    seconds: float,
    stopped: str | None,
) -> dict[str, Any]:
    recent = [loss for loss in losses[-50:] if loss == loss]  # NaN: a step with nothing to train on
    report: dict[str, Any] = {
        "sequences": len(sequences),
        "chain_tokens": state.tokens if state else 0,
        "steps": state.step if state else 0,
        "hidden_states_s": round(read_s, 2),
        "seconds": round(seconds, 2),
        "loss": round(sum(recent) / len(recent), 4) if recent else None,
    }
    if stopped is not None:
        report["stopped"] = stopped
    return report


@torch.no_grad()
def first_token_agreement(head: DraftHead, chains: Chains) -> float:
    """The share of chain starts (at most MEASURED_STARTS, evenly spread) where the head's greedy first
    proposal is the target's likeliest token there (its teacher's first; else the token it chose): what
    greedy verification would accept of it, and a sampled completion's chosen token need not be."""
    starts = chains.starts  # [n]
    if starts.numel() > MEASURED_STARTS:
        starts = starts[torch.linspace(0, starts.numel() - 1, MEASURED_STARTS).long()]
    weights = next(head.parameters())
    state = head.step(chains.states[starts].to(weights.device, weights.dtype), chains.tokens[starts].to(weights.device))
    proposed = head.vocab_ids[head.logits(state).argmax(dim=-1)].cpu()  # [n]
    likeliest = chains.tokens if chains.top_ids is None else chains.top_ids[:, 0]  # [positions]
    return float((proposed == likeliest[starts + 1]).float().mean())


@torch.no_grad()
def with_teacher(target: Any, chains: Chains, top_k: int = TEACHER_TOP_K) -> Chains:
    """`chains` with the target's `top_k` likeliest tokens at each position, as the engine's logprobs
    give them to `draft train` (distill/corpus.py Decoded: the top tokens, then the chosen token where it
    is not among them, else padding): the target's LM head over the states it read, so the head trains
    on the target's distribution, not on its one token (DistillSpec)."""
    lm_head = target.get_output_embeddings()
    weights = lm_head.weight
    top_ids, top_logprobs = [], []
    for states, chosen in zip(chains.states.split(_TEACHER_ROWS), chains.tokens.split(_TEACHER_ROWS), strict=True):
        logprobs = torch.log_softmax(lm_head(states.to(weights.device, weights.dtype)).float(), dim=-1).cpu()
        top = logprobs.topk(top_k, dim=-1)
        among = (top.indices == chosen.unsqueeze(1)).any(dim=1)
        chosen_logprob = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
        top_ids.append(torch.cat([top.indices, torch.where(among, 0, chosen).unsqueeze(1)], dim=1))
        padding = torch.where(among, -math.inf, chosen_logprob)
        top_logprobs.append(torch.cat([top.values, padding.unsqueeze(1)], dim=1))
    return replace(chains, top_ids=torch.cat(top_ids), top_logprobs=torch.cat(top_logprobs))


def head_weights(head: DraftHead) -> bytes:
    """The head's own weights as the bytes of its folder's weights file (DraftHead.save)."""
    buffer = io.BytesIO()
    torch.save({name: value.detach().cpu() for name, value in head.state_dict().items()}, buffer)
    return buffer.getvalue()


def head_config(head: DraftHead) -> dict[str, Any]:
    return asdict(head.config)


def restored_head(config: dict[str, Any], weights: bytes, target: Any) -> DraftHead:
    """The head `head_config` and `head_weights` describe, on `target`; ValueError with a sentence where
    they do not fit it."""
    saved = torch.load(io.BytesIO(weights), map_location="cpu", weights_only=True)
    head = DraftHead(target, HeadConfig(**config), saved["vocab_ids"])
    head.load_state_dict(saved)
    return head.eval()
