"""Training a draft head (decoding/draft_head.py) on the target's decoded completions.

The head reads the target's final hidden states, so its data is one target forward over each stored
sequence (prompt and completion; no decode again): the hidden state at every position that predicted
a completion token. A training example is a chain from one such position j: the state there, then
the completion's tokens fed in turn, each step trained (cross-entropy) to predict the target's next
token, up to `depth` steps: exactly the path greedy verification accepts (teacher forcing), and its
state drawn towards the target's own state there (EAGLE's feature loss, `FEATURE_WEIGHT`). Every
position of every completion starts a chain, so 1,000 completions of 128 tokens give 128,000.

The vocabulary V' the head proposes from: the tokens of the completions by frequency, then the
target's recorded alternatives (its top-20 at each position), then the prompts' tokens, then ids in
order, the first `vocab_rows` of them; `coverage` says what share of completion tokens it holds.

The head's budget, as the draft model's, is training tokens (chain steps) or seconds; the target's
forward over the sequences counts in the seconds, since the draft model does not need it.

A run checkpoints and resumes as the draft model's does (distill/trainer.py CheckpointedTraining):
the checkpoint holds the head's weights, the optimizer, the chain order's generator, the epoch's order
and its cursor, so a resumed run takes the very chains the uninterrupted one would. The hidden states
are read once and kept in the work folder (`read_chains`: part by part as the target reads them, so a
kill mid-read loses one part, then whole), in bf16: half of fp32's size (SmolLM2's
576-wide states take 1.2 KB a position, 58 MB for 50,000) and what a CUDA target in bf16 computes
anyway; every run trains on the stored (rounded) states, read back or not, so a resumed run trains on
what the uninterrupted one did.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from specq.budget import Budget
from specq.decoding.draft_head import DraftHead, HeadConfig
from specq.distill.corpus import Decoded
from specq.distill.trainer import CheckpointedTraining, TrainState, learning_rate, save_atomically

HEAD_BATCH = 256  # chains a step: the head is small, so a step is cheap and many chains keep it steady
# EAGLE's feature loss beside the tokens' (Li et al. 2024): each step's state is also drawn to the
# target's own state at that position (smooth L1, a position's mean over the width, weighted so). On
# SmolLM2-135M's 1,000-prompt completions it raised simulated acceptance at K = 4 from 0.253 to 0.268
# (512 steps) and 0.262 to 0.279 (1,024); weights 0.3 and 3 gave 0.255 and 0.265 (docs/draft-train.md)
FEATURE_WEIGHT = 1.0
READ_PART = 64  # sequences a stored part of the hidden states holds: what a kill mid-read reads again
STORED_STATES_DTYPE = torch.bfloat16  # the module's docstring says why


def head_vocabulary(sequences: Sequence[Decoded], rows: int, vocab_size: int) -> torch.Tensor:
    """The `rows` target ids the head proposes from (see the module's docstring), [rows] int64."""
    ranked: dict[int, None] = {}
    said = Counter(token for s in sequences for token in s.completion)
    alternatives = Counter(token for s in sequences for ids in s.top_ids or () for token in ids)
    prompted = Counter(token for s in sequences for token in s.prompt)
    for counts in (said, alternatives, prompted):
        for token, _ in counts.most_common():
            if 0 <= token < vocab_size:
                ranked.setdefault(token)
    for token in range(vocab_size):
        if len(ranked) >= rows:
            break
        ranked.setdefault(token)
    return torch.tensor(list(ranked)[:rows], dtype=torch.int64)


def coverage(sequences: Sequence[Decoded], vocab_ids: torch.Tensor) -> float:
    """The share of the completions' tokens that are in the head's vocabulary."""
    inside = set(vocab_ids.tolist())
    tokens = [token for s in sequences for token in s.completion]
    return sum(token in inside for token in tokens) / max(1, len(tokens))


@dataclass
class Chains:
    """Every chain start of the training data, flattened: `states` [n, H] the target's hidden state at
    each completion-predicting position, `tokens` [n] the completion token predicted there, and `left`
    [n] how many tokens of its completion follow it (the chain from it trains at most that deep)."""

    states: torch.Tensor
    tokens: torch.Tensor
    left: torch.Tensor
    # where the decode kept them: the target's likeliest tokens where it chose each token, [n, top_k + 1]
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None  # -inf where padded

    @property
    def starts(self) -> torch.Tensor:
        """The chain starts with something to predict: a token after the one fed first."""
        return torch.nonzero(self.left > 0).squeeze(1)


@torch.no_grad()
def target_states(
    target: Any, sequences: Sequence[Decoded], on_sequence: Callable[[int], None] = lambda done: None
) -> Chains:
    """One target forward over each sequence: the final hidden states at its completion-predicting
    positions (what the target's LM head read when it chose each completion token); no chain at all
    where no sequence has both a prompt and a completion."""
    device = next(target.parameters()).device
    hidden_size = int(target.get_input_embeddings().weight.shape[1])
    states = [torch.zeros(0, hidden_size)]
    tokens, left = [torch.zeros(0, dtype=torch.int64)], [torch.zeros(0, dtype=torch.int64)]
    top_ids, top_logprobs, kept = [], [], 0
    base = target.base_model
    for done, sequence in enumerate(sequences, 1):
        count = len(sequence.completion)
        if not sequence.prompt or count == 0:
            continue
        kept += 1
        ids = torch.tensor([sequence.token_ids], device=device)
        hidden = base(input_ids=ids).last_hidden_state[0]  # [T, H] after the final norm
        states.append(hidden[len(sequence.prompt) - 1 : len(sequence.token_ids) - 1].float().cpu())
        tokens.append(torch.tensor(sequence.completion))
        left.append(torch.arange(count - 1, -1, -1))
        if sequence.top_ids is not None and sequence.top_logprobs is not None:
            top_ids.append(torch.tensor(sequence.top_ids, dtype=torch.int64))
            top_logprobs.append(torch.tensor(sequence.top_logprobs, dtype=torch.float32))
        on_sequence(done)
    tops = (torch.cat(top_ids), torch.cat(top_logprobs)) if kept and len(top_ids) == kept else (None, None)
    return Chains(torch.cat(states), torch.cat(tokens), torch.cat(left), *tops)


def joined(parts: Sequence[Chains]) -> Chains:
    """The chains of consecutive parts as one; the recorded top tokens only where every part with a
    chain has them."""
    held = [part for part in parts if part.tokens.numel()]
    top_ids = [part.top_ids for part in held if part.top_ids is not None]
    top_logprobs = [part.top_logprobs for part in held if part.top_logprobs is not None]
    with_tops = bool(held) and len(top_ids) == len(top_logprobs) == len(held)
    return Chains(
        torch.cat([part.states for part in parts]),
        torch.cat([part.tokens for part in parts]),
        torch.cat([part.left for part in parts]),
        torch.cat(top_ids) if with_tops else None,
        torch.cat(top_logprobs) if with_tops else None,
    )


def read_chains(
    target: Any,
    sequences: Sequence[Decoded],
    path: Path,
    on_progress: Callable[[int, int, int], None] = lambda done, total, tokens: None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Chains, float]:
    """The chains of `sequences` and the target's seconds reading them (on `clock`), stored in `path`
    (`save_chains`). The target reads them READ_PART sequences at a time, each part stored beside `path`
    as it is read, so a read killed midway resumes at its first missing part; the parts go once `path`
    is written. `on_progress(sequences read, all, tokens this try read)` after each part."""
    parts, read_s, tokens = [], 0.0, 0
    on_progress(0, len(sequences), 0)
    part_paths = [path.with_name(f"{path.stem}.part{n:05d}.pt") for n in range(math.ceil(len(sequences) / READ_PART))]
    for number, part_path in enumerate(part_paths):
        stored = load_chains(part_path)
        if stored is None:
            started = clock()
            part = sequences[number * READ_PART : (number + 1) * READ_PART]
            chains = target_states(target, part)
            seconds = clock() - started
            tokens += sum(len(sequence.token_ids) for sequence in part)
            stored = save_chains(chains, seconds, part_path), seconds
        parts.append(stored[0])
        read_s += stored[1]
        on_progress(min((number + 1) * READ_PART, len(sequences)), len(sequences), tokens)
    whole = joined(parts)
    if whole.tokens.numel() == 0:
        raise ValueError("no training sequence has both a prompt and a completion")
    save_chains(whole, read_s, path)
    for part_path in part_paths:
        part_path.unlink()
    return whole, read_s


def save_chains(chains: Chains, read_s: float, path: Path) -> Chains:
    """Store `chains` and the seconds the target took to read them in `path` (atomically); the chains as
    stored (their states rounded to STORED_STATES_DTYPE), which the run trains on."""
    stored = Chains(**{**vars(chains), "states": chains.states.to(STORED_STATES_DTYPE)})
    save_atomically({**vars(stored), "read_s": read_s}, path)
    return stored


def load_chains(path: Path) -> tuple[Chains, float] | None:
    """(chains, read_s) as `save_chains` stored them; None where `path` is not there."""
    if not path.exists():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    return Chains(**{field.name: saved[field.name] for field in fields(Chains)}), float(saved["read_s"])


class HeadTrainer(CheckpointedTraining):
    """Teacher-forced chains of `depth` steps from every completion position, AdamW with the draft
    trainer's warm-up and cosine schedule, until the budget is spent; checkpointed as the draft model's
    trainer is (`run`, `restore`)."""

    def __init__(
        self,
        head: DraftHead,
        chains: Chains,
        budget: Budget,
        depth: int,
        learning_rate: float = 1e-3,
        batch_size: int = HEAD_BATCH,
        seed: int = 0,
        elapsed_s: float = 0.0,
        soft: bool = True,
        checkpoint_every: int = 50,
        feature_weight: float = FEATURE_WEIGHT,
    ) -> None:
        self.head, self.chains, self.budget, self.depth = head, chains, budget, depth
        self.checkpoint_every = checkpoint_every
        self.learning_rate, self.batch_size = learning_rate, batch_size
        self.soft = soft  # on the recorded top tokens where there are (distillation), else on the chosen token
        self.feature_weight = feature_weight  # FEATURE_WEIGHT says why; 0: the tokens' loss alone
        self.starts = chains.starts
        if self.starts.numel() == 0:
            raise ValueError("no completion is two tokens long: nothing to train the head on")
        # target id -> row of the head's vocabulary, -1 outside it (never proposed: not trained on)
        rows = torch.full((head.target_vocab_size,), -1, dtype=torch.int64)
        rows[head.vocab_ids.cpu()] = torch.arange(head.vocab_ids.numel())
        self.vocab_row = rows
        trained = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=learning_rate, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(self.starts.numel(), generator=self.generator)
        self.cursor = 0
        self.state = TrainState(elapsed_s=elapsed_s)

    def _checkpoint(self) -> dict[str, Any]:
        return {
            "model": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "order": self.order,
            "cursor": self.cursor,
        }

    def _resume(self, saved: dict[str, Any]) -> None:
        # the vocabulary is chosen from the stored sequences, deterministically: another one would leave
        # the head's LM-head rows (taken from the target at its creation) out of step with its ids
        if not torch.equal(saved["model"]["vocab_ids"], self.head.vocab_ids.cpu()):
            raise ValueError("the checkpoint's head proposes from another vocabulary than this run's")
        self.head.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.generator.set_state(saved["generator"])
        self.order, self.cursor = saved["order"], int(saved["cursor"])

    def _next_starts(self) -> torch.Tensor:
        if self.cursor + self.batch_size > self.order.numel():  # a new epoch
            self.order = torch.randperm(self.starts.numel(), generator=self.generator)
            self.cursor = 0
        picked = self.order[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return self.starts[picked]

    def step(self) -> float:
        chains, head = self.chains, self.head
        starts = self._next_starts()  # [b]
        weights = next(head.parameters())  # the head is in the target's dtype (bf16 on CUDA by default)
        device = weights.device
        state = chains.states[starts].to(device, weights.dtype)  # [b, H]
        losses, counted = [], 0
        for i in range(1, self.depth + 1):
            valid = chains.left[starts] >= i  # [b] the completion goes on for i more tokens
            fed = chains.tokens[(starts + i - 1).clamp(max=chains.tokens.numel() - 1)]  # [b]
            wanted = self.vocab_row[chains.tokens[(starts + i).clamp(max=chains.tokens.numel() - 1)]]  # [b]
            state = head.step(state, fed.to(device))
            trained = valid & (wanted >= 0)
            if not trained.any():
                break
            logits = head.logits(state[trained.to(device)]).float()  # [m, V']
            at = (starts + i)[trained]  # [m] the positions whose tokens these logits predict
            losses.append(self._loss(logits, at, wanted[trained]))
            if self.feature_weight:  # the target's state at the position this step's state stands for
                wanted_state = chains.states[(starts + i)[valid]].to(device, torch.float32)
                distance = torch.nn.functional.smooth_l1_loss(
                    state[valid.to(device)].float(), wanted_state, reduction="none"
                )
                losses.append(self.feature_weight * distance.mean(dim=-1).sum())
            counted += int(trained.sum())
        if not losses:  # every chain's first token outside the head's vocabulary: a step, with no update
            self.state.step += 1
            return math.nan
        loss = torch.stack(losses).sum() / counted
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.learning_rate, self.state.step, self.state.fraction(self.budget))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optimizer.step()
        self.state.step += 1
        self.state.tokens += counted
        return float(loss.detach())

    def _loss(self, logits: torch.Tensor, at: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy of `logits` [m, V'] against the target at chain positions `at` [m]: its
        recorded top tokens (those in the head's vocabulary, renormalised) where the decode kept them,
        else the token it chose (`wanted` [m], rows of the head's vocabulary)."""
        device = logits.device
        log_probs = torch.log_softmax(logits, dim=-1)
        if self.chains.top_ids is None or self.chains.top_logprobs is None or not self.soft:
            return -log_probs.gather(1, wanted.to(device).unsqueeze(1)).sum()
        rows = self.vocab_row[self.chains.top_ids[at]].to(device)  # [m, top_k + 1], -1 outside V'
        known = (rows >= 0) & torch.isfinite(self.chains.top_logprobs[at]).to(device)
        weights = torch.where(known, self.chains.top_logprobs[at].to(device), float("-inf")).softmax(dim=-1)
        picked = log_probs.gather(1, rows.clamp(min=0))  # [m, top_k + 1]
        return -(torch.where(known, weights * picked, 0.0)).sum()


def new_head(target: Any, sequences: Sequence[Decoded], vocab_rows: int, intermediate: int | None) -> DraftHead:
    """An untrained head for `target`, its vocabulary chosen from `sequences`."""
    embedding = target.get_input_embeddings().weight
    vocab_size = int(target.get_output_embeddings().weight.shape[0])
    hidden = int(embedding.shape[1])
    config = HeadConfig(
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        vocab_rows=min(vocab_rows, vocab_size),
        target_vocab_size=vocab_size,
    )
    return DraftHead(target, config, head_vocabulary(sequences, config.vocab_rows, vocab_size))
