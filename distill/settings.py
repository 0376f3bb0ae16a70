"""What a `specq draft train` run is told: one frozen dataclass, stored in the work state so that a resumed
run can tell whether it is still the same run."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from specq.budget import Budget
from specq.decoding.types import SamplingParams
from specq.limits import COMPILE_MODES

Loss = Literal["fkl", "tvd"]
LOSSES: tuple[Loss, ...] = ("fkl", "tvd")
# what the command trains: a stand-alone draft model, or a draft head on the target's hidden states
# (distill/head.py); docs/draft-train.md says which is the default and why
ProposerKind = Literal["model", "head"]
PROPOSER_KINDS: tuple[ProposerKind, ...] = ("model", "head")
MODEL_LEARNING_RATE, HEAD_LEARNING_RATE = 1e-3, 3e-3
HEAD_VOCAB = 8192  # V': the target's LM-head rows a head proposes from (distill/head.py)
TEACHER_TOP_K = 20  # the target's likeliest tokens a position trains on; the engine's logprobs give 20 at most


@dataclass(frozen=True)
class DraftShape:
    """The draft's size; None: chosen from the target (distill/sizing.py)."""

    layers: int | None = None
    hidden: int | None = None
    intermediate: int | None = None

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value is not None and value < 1:
                raise ValueError(f"the draft's {name} must be >= 1, got {value}")


@dataclass(frozen=True)
class DistillSettings:
    target: str
    data: str  # the prompts file, as the user named it
    # the target's decode, a line's own settings over these (jobs.params.sampling_params), and the held-out
    # measurement's; greedy unless asked: the draft learns what the target would most likely say
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    chat_template: str | None = None
    device: str | None = None
    dtype: str | None = None
    decode_batch_size: int = 32  # cli/draft.py's --batch-size says why
    budget: Budget = field(default_factory=lambda: Budget(tokens=200_000))
    proposer: ProposerKind = "head"  # docs/draft-train.md, Measured: it beat the model at the same training time
    head_vocab: int = HEAD_VOCAB
    head_intermediate: int | None = None  # the head's MLP width; None: twice the target's width
    shape: DraftShape = DraftShape()
    loss: Loss = "fkl"
    # the target's likeliest tokens a position that the decode keeps to train on (no target forward while
    # training); 0: the target's whole distribution, recomputed by a forward each step
    teacher_top_k: int = TEACHER_TOP_K
    learning_rate: float | None = None  # AdamW's peak (distill/trainer.py's schedule); None: `peak_learning_rate`
    train_batch_size: int = 8  # sequences a step
    max_train_tokens: int = 1024  # longer sequences keep their last tokens
    checkpoint_every: int = 50  # steps between checkpoints
    heldout: int | None = None  # held-out prompts; None: a tenth of them, 1 to 32
    seed: int = 0  # the split, the draft's init and the order of the batches
    eval_batch_sizes: tuple[int, ...] = (1,)
    num_speculative_tokens: int = 4  # K of the held-out measurement
    eval_warmup: int = 1  # untimed passes of each contender before its timed one, as `specq bench`
    eval_repeats: int = 1  # timed passes of each contender, in turns, as `specq bench --repeats`
    eval_compile: str = "auto"  # the measurement's forwards, as `--compile` (decoding.compiled), both sides alike

    def __post_init__(self) -> None:
        if self.proposer not in PROPOSER_KINDS:
            raise ValueError(f"proposer must be one of {', '.join(PROPOSER_KINDS)}, got {self.proposer!r}")
        if self.head_vocab < 1 or (self.head_intermediate is not None and self.head_intermediate < 1):
            raise ValueError("the head's vocabulary and width must be >= 1")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        for name in ("decode_batch_size", "train_batch_size", "max_train_tokens", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.teacher_top_k <= 20:  # the engine's logprobs give 20 alternatives at most
            raise ValueError(f"teacher_top_k must be in [0, 20], got {self.teacher_top_k}")
        if self.heldout is not None and self.heldout < 1:
            raise ValueError(f"heldout must be >= 1, got {self.heldout}")
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be positive, got {self.learning_rate}")
        if self.eval_repeats < 1:
            raise ValueError(f"eval_repeats must be >= 1, got {self.eval_repeats}")
        if self.eval_compile not in COMPILE_MODES:
            raise ValueError(f"eval_compile must be one of {', '.join(COMPILE_MODES)}, got {self.eval_compile!r}")
        if not self.eval_batch_sizes or min(self.eval_batch_sizes) < 1:
            raise ValueError(f"eval batch sizes must be >= 1, got {self.eval_batch_sizes}")

    @property
    def peak_learning_rate(self) -> float:
        """The learning rate given, else the proposer's: a head's few weights train faster at 3e-3 (on
        SmolLM2-135M's completions, teacher-forced acceptance 0.22 after 60 s against 0.16 at 1e-3)."""
        if self.learning_rate is not None:
            return self.learning_rate
        return HEAD_LEARNING_RATE if self.proposer == "head" else MODEL_LEARNING_RATE

    def heldout_count(self, prompts: int) -> int:
        """Prompts kept out of training: `heldout`, else a tenth, 1 to 32; at least one is left to train on."""
        wanted = self.heldout if self.heldout is not None else min(32, max(1, prompts // 10))
        return min(wanted, prompts - 1)

    def identity(self) -> dict[str, Any]:
        """What must be the same for a run to resume another: everything that decides the weights. The
        device, dtype and the evaluation's settings may change between tries."""
        out = asdict(self)
        for name in ("device", "dtype", "eval_batch_sizes", "eval_warmup", "eval_repeats", "eval_compile"):
            out.pop(name)
        if self.proposer == "model":  # a head trains chains K deep: K decides its weights, not a model's
            out.pop("num_speculative_tokens")
        # as the work state keeps it (tuples as lists), so that a stored identity compares equal to it
        return json.loads(json.dumps(out))
