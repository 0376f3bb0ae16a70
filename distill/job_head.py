"""A draft head trained in place, for a job that pays for its own draft (`submit --draft train:N`):
the head of `specq draft train --proposer head`, on completions a job already has, with the target a
worker already holds, in memory and in one go.

What `draft train` adds around the same trainer (a work folder, checkpoints, resuming, held-out
measurement) is left out: the job measures the head as it speculates with it, and a worker that dies
while training costs the training's time, which the next worker spends again. Plain torch: the worker
(worker/trained_draft.py) gathers the completions and stores the head.
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


@dataclass(frozen=True)
class TrainedHead:
    head: DraftHead
    report: dict[str, Any]  # sequences, chain tokens, steps, seconds, the last steps' loss


def train_job_head(
    target: Any,
    sequences: Sequence[Decoded],
    budget: Budget,
    depth: int,
    seed: int = 0,
    on_step: Callable[[TrainState], None] = lambda state: None,
) -> TrainedHead:
    """A head for `target` trained on `sequences` (prompt and completion token ids) until `budget` is
    spent: the target reads their hidden states once, then chains of `depth` steps train as in
    distill/head.py. `on_step` after each step; an exception from it stops training and goes up.
    ValueError where no sequence has a completion two tokens long."""
    started = time.perf_counter()
    torch.manual_seed(seed)
    head = new_head(target, sequences, HEAD_VOCAB, None)
    chains = with_teacher(target, target_states(target, sequences))
    # rounded as `draft train` stores them: half of fp32's memory, and the same training
    chains = replace(chains, states=chains.states.to(STORED_STATES_DTYPE))
    read_s = time.perf_counter() - started
    trainer = HeadTrainer(
        head, chains, budget, depth=depth, learning_rate=HEAD_LEARNING_RATE, seed=seed, elapsed_s=read_s
    )
    losses = []
    # its own loop, not the trainer's `run`: that checkpoints to a folder every few steps (the head and
    # its optimizer, tens of MB each time), which a job that trains again from the start has no use for
    with torch.enable_grad():
        while not trainer.done():
            step_started = time.perf_counter()
            losses.append(trainer.step())
            trainer.state.elapsed_s += time.perf_counter() - step_started
            on_step(trainer.state)
    head.eval()
    recent = [loss for loss in losses[-50:] if loss == loss]  # NaN: a step with nothing to train on
    report = {
        "sequences": len(sequences),
        "chain_tokens": trainer.state.tokens,
        "steps": trainer.state.step,
        "hidden_states_s": round(read_s, 2),
        "seconds": round(time.perf_counter() - started, 2),
        "loss": round(sum(recent) / len(recent), 4) if recent else None,
    }
    return TrainedHead(head, report)


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
