"""Training the draft on the target's distributions (knowledge distillation, Hinton et al. 2015; for
speculative decoding DistillSpec, Zhou et al. 2024).

Each step takes a batch of decoded sequences (prompt and the target's completion) and, at every
position that predicts a completion token, moves the draft's next-token distribution towards the
target's. Two teachers:

    StoredTeacher  the target's top-k tokens a position (20 by default), which the engine recorded as
                   it decoded (its logprobs): no target forward while training, so a step costs the
                   draft's forward and backward alone (SmolLM2-135M's 17.7M-parameter draft, 8
                   sequences a step, on 1 thread of a loaded CPU: about 10 s a step, 25 s with the
                   target's forward); the divergence is that of the distributions coarsened to those
                   tokens and one bucket for the rest;
    Teacher        the whole distribution, recomputed by a target forward without gradients each step;
                   exact, and it also trains the position after the last token (where the target ends).

Divergences, both from DistillSpec's menu, the same on every position:

    fkl   forward KL, KL(target || draft): mass wherever the target puts mass;
    tvd   total variation distance, 1/2 sum |target - draft|: what acceptance loses (Leviathan et al.
          2023: a draft token is accepted with probability 1 - TVD(target, draft) when sampled).

Determinism: the batches of step s are drawn from a permutation seeded by (seed, epoch), so a run
resumed from a checkpoint takes exactly the batches the uninterrupted run would have; on the same
machine and thread count the weights match too. The checkpoints and the loop that writes them
(`CheckpointedTraining`) are the draft head's too (distill/head.py).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specq.budget import Budget
from specq.distill.corpus import Decoded
from specq.distill.settings import Loss
from specq.distill.workdir import CHECKPOINT

if TYPE_CHECKING:
    from transformers import PreTrainedModel

WARMUP_STEPS = 20  # linear learning-rate warm-up: Adam's first moments are noise
FINAL_LR_FRACTION = 0.1  # cosine decay to this share of the learning rate as the budget runs out


class TrainingInterrupted(Exception):
    """Ctrl-C during training: the step under way finished, a checkpoint was written."""


@dataclass
class TrainState:
    """Where training is; saved in every checkpoint."""

    step: int = 0
    tokens: int = 0  # positions trained on so far
    elapsed_s: float = 0.0  # training wall time so far, over every try
    checkpoints: int = 0  # scheduled checkpoints written (one every `checkpoint_every` steps)
    loss: float = math.nan  # the mean loss of the steps since the last checkpoint

    def fraction(self, budget: Budget) -> float:
        if budget.tokens is not None:
            return min(1.0, self.tokens / budget.tokens)
        assert budget.seconds is not None
        return min(1.0, self.elapsed_s / budget.seconds)


StepProgress = Callable[[TrainState], None]


@dataclass(frozen=True)
class Batch:
    """One step's sequences as tensors, right-padded."""

    input_ids: torch.Tensor  # [batch, time]
    attention_mask: torch.Tensor  # [batch, time]
    positions: torch.Tensor  # [batch, time], bool: the n positions trained on, row by row
    top_ids: torch.Tensor | None  # [n, top_k + 1]: the target's likeliest next tokens there (stored)
    top_logprobs: torch.Tensor | None  # [n, top_k + 1], -inf where padded


@dataclass(frozen=True)
class TopK:
    """The target's distribution at n positions, known on its likeliest tokens only."""

    ids: torch.Tensor  # [n, m]
    logprobs: torch.Tensor  # [n, m], -inf where padded


class Teacher:
    """The target's whole next-token distribution, recomputed by a forward without gradients."""

    final_position = True  # it also knows the position after the completion's last token

    def __init__(self, target: PreTrainedModel) -> None:
        self.target = target

    def targets(self, batch: Batch) -> torch.Tensor | TopK:
        return self.log_probs(batch.input_ids, batch.attention_mask, batch.positions)

    @torch.no_grad()
    def log_probs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[n, vocab] log-probabilities at the n True `positions` ([batch, time]) of `input_ids`."""
        return next_token_log_probs(self.target, input_ids, attention_mask, positions).float()


class StoredTeacher:
    """The target's top-k next tokens as its decode recorded them (corpus.Decoded): no target forward."""

    final_position = False  # the decode recorded the positions of emitted tokens only

    def targets(self, batch: Batch) -> torch.Tensor | TopK:
        assert batch.top_ids is not None and batch.top_logprobs is not None, "sequences decoded without top-k"
        return TopK(batch.top_ids, batch.top_logprobs)


def next_token_log_probs(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """[n, vocab] log-softmax of `model`'s logits at the n True `positions` only: the output head over
    the whole batch would hold batch x time x vocabulary logits (1.2 GB for 8 x 256 tokens at SmolLM2's
    49k vocabulary in fp32)."""
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [b, t, h]
    logits = model.get_output_embeddings()(hidden[positions]).float()  # [n, vocab]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return torch.log_softmax(logits, dim=-1)


def divergence(loss: Loss, target: torch.Tensor | TopK, draft_log_probs: torch.Tensor) -> torch.Tensor:
    """The mean over positions of the divergence `loss` between the target's distributions (`target`:
    [n, vocab] log-probabilities, or its top tokens) and the draft's ([n, vocab] log-probabilities)."""
    if isinstance(target, TopK):
        return _top_divergence(loss, target, draft_log_probs)
    vocab = min(target.shape[-1], draft_log_probs.shape[-1])
    target_log_probs, draft_log_probs = target[:, :vocab], draft_log_probs[:, :vocab]
    target_probs = target_log_probs.exp()  # [n, vocab]
    if loss == "fkl":
        per_position = (target_probs * (target_log_probs - draft_log_probs)).sum(-1)  # [n]
    else:
        per_position = 0.5 * (target_probs - draft_log_probs.exp()).abs().sum(-1)  # [n]
    return per_position.mean()


def _top_divergence(loss: Loss, target: TopK, draft_log_probs: torch.Tensor) -> torch.Tensor:
    """The divergence between the two distributions coarsened to the target's top tokens and one bucket
    for all the rest (the exact divergence of those coarsened distributions, a lower bound of the whole's)."""
    known = torch.isfinite(target.logprobs)  # [n, m]
    target_log_probs = torch.where(known, target.logprobs, 0.0)  # [n, m]
    target_probs = torch.where(known, target_log_probs.exp(), 0.0)  # [n, m]
    draft_top = draft_log_probs.gather(-1, target.ids)  # [n, m]
    draft_probs = torch.where(known, draft_top.exp(), 0.0)  # [n, m]
    target_rest = (1 - target_probs.sum(-1)).clamp_min(0.0)  # [n]
    draft_rest = (1 - draft_probs.sum(-1)).clamp_min(1e-6)  # [n]
    if loss == "fkl":
        top = torch.where(known, target_probs * (target_log_probs - draft_top), 0.0).sum(-1)  # [n]
        per_position = top + torch.xlogy(target_rest, target_rest) - target_rest * draft_rest.log()
    else:
        per_position = 0.5 * ((target_probs - draft_probs).abs().sum(-1) + (target_rest - draft_rest).abs())
    return per_position.mean()


@dataclass(frozen=True)
class Window:
    """One training sequence as trained on: at most `max_tokens` tokens, the positions trained on
    (`loss_start` to `loss_end`, exclusive) and, where stored, the target's top tokens at each."""

    token_ids: tuple[int, ...]
    loss_start: int
    loss_end: int
    top_ids: tuple[tuple[int, ...], ...] | None = None
    top_logprobs: tuple[tuple[float, ...], ...] | None = None

    @classmethod
    def of(cls, sequence: Decoded, max_tokens: int, final_position: bool) -> Window:
        """Position i predicts token i + 1: the completion's tokens are predicted from len(prompt) - 1 on,
        and `final_position` adds the position after the last (where the target would end). A sequence
        longer than `max_tokens` keeps its last tokens."""
        tokens = sequence.token_ids
        first = len(sequence.prompt) - 1  # may be -1: the first completion token is then not trained on
        end = len(tokens) - (0 if final_position else 1)
        cut = max(0, len(tokens) - max_tokens)
        skipped = max(0, cut - first)  # trained positions lost to the cut (or to an empty prompt)
        start = first + skipped
        tops = (sequence.top_ids, sequence.top_logprobs)
        if tops[0] is not None and tops[1] is not None:
            tops = (tops[0][skipped : skipped + end - start], tops[1][skipped : skipped + end - start])
        return cls(tokens[cut:], start - cut, end - cut, *tops)

    @property
    def loss_positions(self) -> int:
        return self.loss_end - self.loss_start


def batch_indices(step: int, count: int, batch_size: int, seed: int) -> list[int]:
    """The sequences of step `step`: consecutive slices of a permutation per epoch, seeded by (seed,
    epoch), so any step's batch is known without replaying the ones before it."""
    size = min(batch_size, count)
    chosen: list[int] = []
    first = step * size
    for position in range(first, first + size):
        epoch, offset = divmod(position, count)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        chosen.append(int(torch.randperm(count, generator=generator)[offset]))
    return chosen


def collate(windows: Sequence[Window], pad_id: int, device: torch.device) -> Batch:
    """The windows as one right-padded batch; their stored top tokens (if every window has them) in the
    order of the positions, row by row."""
    width = max(len(w.token_ids) for w in windows)
    input_ids = torch.full((len(windows), width), pad_id, dtype=torch.long)  # [batch, time]
    attention_mask = torch.zeros(len(windows), width, dtype=torch.long)  # [batch, time]
    positions = torch.zeros(len(windows), width, dtype=torch.bool)  # [batch, time]
    for row, window in enumerate(windows):
        n = len(window.token_ids)
        input_ids[row, :n] = torch.tensor(window.token_ids)
        attention_mask[row, :n] = 1
        positions[row, window.loss_start : window.loss_end] = True
    top_ids = top_logprobs = None
    if all(w.top_ids is not None for w in windows):
        top_ids = torch.tensor([ids for w in windows for ids in w.top_ids or ()], dtype=torch.long).to(device)
        top_logprobs = torch.tensor([v for w in windows for v in w.top_logprobs or ()], dtype=torch.float32).to(device)
    return Batch(input_ids.to(device), attention_mask.to(device), positions.to(device), top_ids, top_logprobs)


def learning_rate(base: float, step: int, fraction: float) -> float:
    """Linear warm-up over WARMUP_STEPS, then cosine decay to FINAL_LR_FRACTION by the end of the budget."""
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    cosine = FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * fraction))
    return base * warm * cosine


def save_atomically(payload: dict[str, Any], path: Path) -> None:
    """`payload` in `path` (torch.save), written then renamed: a kill leaves the previous file or this
    one, never half of one."""
    partial = path.with_name(path.name + ".partial")
    torch.save(payload, partial)
    os.replace(partial, path)


class CheckpointedTraining:
    """The training loop both trainers share: steps until the budget is spent, a checkpoint (the
    trainer's own `_checkpoint()` and the TrainState) every `checkpoint_every` steps, on Ctrl-C and at
    the end, and `restore` to continue from it. A trainer gives `step` (one optimizer step, which counts
    in `state`) and what its checkpoint holds besides the state."""

    state: TrainState
    budget: Budget
    checkpoint_every: int

    def step(self) -> float:
        """One optimizer step on the next batch; its loss (NaN where the batch had nothing to train on)."""
        raise NotImplementedError

    def _checkpoint(self) -> dict[str, Any]:
        raise NotImplementedError

    def _resume(self, saved: dict[str, Any]) -> None:
        raise NotImplementedError

    def save(self, folder: Path) -> None:
        """The weights, the optimizer, whatever else decides the next batches and the state in
        `folder`/checkpoint.pt (atomically)."""
        save_atomically({**self._checkpoint(), "state": vars(self.state)}, folder / CHECKPOINT)

    def restore(self, folder: Path) -> bool:
        """Continue from `folder`'s checkpoint; False where there is none."""
        path = folder / CHECKPOINT
        if not path.exists():
            return False
        saved = torch.load(path, map_location="cpu", weights_only=True)
        self._resume(saved)
        self.state = TrainState(**saved["state"])
        return True

    def done(self) -> bool:
        return self.state.fraction(self.budget) >= 1.0

    def run(
        self,
        folder: Path,
        on_step: StepProgress = lambda state: None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        stop_at: float | None = None,
    ) -> TrainState:
        """Train until the budget is spent, checkpointing into `folder` every `checkpoint_every` steps and
        at the end; Ctrl-C finishes the step under way, checkpoints and raises TrainingInterrupted. Times
        on `clock`. With `stop_at` (a time on `clock`: a whole command's limit), training also ends, its
        budget spent or not, before a step that the last one's time (its checkpoint and `on_step`
        included) says would end past it."""
        losses: list[float] = []
        last_s = 0.0  # the last step's whole time: what the next one is expected to take
        with _sigint_deferred() as interrupted:
            while not self.done() and (stop_at is None or clock() + last_s < stop_at):
                started = clock()
                losses.append(self.step())
                self.state.elapsed_s += clock() - started
                scheduled = self.state.step % self.checkpoint_every == 0 or self.done()
                if scheduled:
                    self.state.checkpoints += 1
                trained = [loss for loss in losses if not math.isnan(loss)]
                self.state.loss = sum(trained) / len(trained) if trained else math.nan
                if scheduled:
                    self.save(folder)
                    losses.clear()
                on_step(self.state)
                last_s = clock() - started
                if interrupted() and not self.done():
                    if not scheduled:
                        self.save(folder)
                    raise TrainingInterrupted(f"interrupted at step {self.state.step}")
        return self.state


@dataclass
class Trainer(CheckpointedTraining):
    draft: PreTrainedModel
    teacher: Teacher | StoredTeacher
    sequences: Sequence[Decoded]
    budget: Budget
    loss: Loss = "fkl"
    learning_rate: float = 1e-3
    batch_size: int = 8
    max_tokens: int = 1024
    checkpoint_every: int = 50
    seed: int = 0
    pad_id: int = 0

    def __post_init__(self) -> None:
        if not self.sequences:
            raise ValueError("no training sequences")
        self.windows = [Window.of(s, self.max_tokens, self.teacher.final_position) for s in self.sequences]
        self.optimizer = torch.optim.AdamW(self.draft.parameters(), lr=self.learning_rate, weight_decay=0.0)
        self.state = TrainState()
        self.device = next(self.draft.parameters()).device

    # -- checkpoints --------------------------------------------------------------------------------
    def _checkpoint(self) -> dict[str, Any]:
        return {"model": self.draft.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _resume(self, saved: dict[str, Any]) -> None:
        self.draft.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])

    # -- training -----------------------------------------------------------------------------------
    def step(self) -> float:
        state = self.state
        indices = batch_indices(state.step, len(self.windows), self.batch_size, self.seed)
        batch = collate([self.windows[i] for i in indices], self.pad_id, self.device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else nullcontext()
        with autocast:
            target = self.teacher.targets(batch)  # [n, vocab] log-probabilities, or the top tokens
            draft_log_probs = next_token_log_probs(
                self.draft, batch.input_ids, batch.attention_mask, batch.positions
            )  # [n, vocab]
        loss = divergence(self.loss, target, draft_log_probs)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.learning_rate, state.step, state.fraction(self.budget))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 1.0)
        self.optimizer.step()
        state.step += 1
        state.tokens += int(batch.positions.sum())
        return float(loss.detach())


@contextmanager
def _sigint_deferred() -> Iterator[Callable[[], bool]]:
    """Within: the first Ctrl-C is noted (the returned function says whether it came) and the step
    under way finishes; a second one interrupts at once. Outside the main thread, nothing changes."""
    noted = {"interrupted": False}

    def handler(signum: int, frame: Any) -> None:
        if noted["interrupted"]:
            raise KeyboardInterrupt
        noted["interrupted"] = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        yield lambda: False
        return
    try:
        yield lambda: noted["interrupted"]
    finally:
        signal.signal(signal.SIGINT, previous)
