"""Engine configuration, one frozen dataclass (nanoGPT's GPTConfig style)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from specq.limits import BATCH_SIZE, MODEL_FREE, NUM_SPECULATIVE_TOKENS, SAMPLING_MODES

SamplingMode = Literal["exact", "reproducible"]  # specq.limits.SAMPLING_MODES
ModelFree = Literal["ngram", "suffix"]  # specq.limits.MODEL_FREE
# (target, draft, dtype, K, fixed k, model-free proposer): `DecodingConfig.policy_key`
PolicyKey = tuple[str, str | None, str | None, int, bool, ModelFree | None]


# K when none is given: a draft model's proposals cost a forward each, so 4; a looked-up proposal costs
# none, and a long match pays up to the verify width (prompt lookup on the grounded workload at batch 1:
# 2.61x target-only with 8, 2.22x with 4, on 44caf84: the command is in that commit's docs/benchmarks.md,
# and the dated log does not hold the run). In a batch of a few rows, 16: a code edit copies spans
# longer than 8 tokens (SmolLM2's greedy code-edit answers replayed through prompt lookup: 35 steps with
# 16 against 45 with 8 at batch 1) and a wide verify costs little more than a plain step (SmolLM2 at
# batch 1 on the 2-core CPU: 17 tokens a row about 2.5 plain steps); in a larger batch, 8: there it costs
# up to its width (16 rows: about 8 plain steps), and with 16 the policy's warm-up and probes of the wide
# widths cost the demo pair's 16-row jobs more than the long matches saved (templated: 0.89x target-only
# with ngram, 0.70x with the hybrid, in one round; docs/benchmark-log/2026-12.md, "Prompt lookup against
# transformers'"). A hybrid with K not given takes each: its draft model goes 4 deep, its lookups 8 or
# 16 (with the draft model as deep too, the hybrid verified wider than the draft model alone for no more
# tokens, and lost to it on continuation at 16 rows; docs/benchmark-log/2026-12.md, "The hybrid's draft
# model goes 4 deep, as it does alone")
DRAFT_MODEL_SPECULATIVE_TOKENS, MODEL_FREE_SPECULATIVE_TOKENS = 4, 8
MODEL_FREE_FEW_ROWS, MODEL_FREE_FEW_ROWS_SPECULATIVE_TOKENS = 4, 16  # batches of at most this many rows: K 16


@dataclass(frozen=True)
class DecodingConfig:
    # K: the most draft tokens a step may propose; None: DRAFT_MODEL_SPECULATIVE_TOKENS, or a model-free
    # proposer's by batch size (MODEL_FREE_FEW_ROWS)
    num_speculative_tokens: int = None  # type: ignore[assignment]  # resolved to an int in __post_init__
    # the most tokens a draft model proposes a step (its forwards); None: K where K is given, else
    # DRAFT_MODEL_SPECULATIVE_TOKENS. Below K only in a hybrid, whose looked-up rows verify up to K;
    # 0 only with K = 0, where no proposer runs (plain decoding with the target)
    draft_model_depth: int = None  # type: ignore[assignment]  # resolved to an int in __post_init__
    fixed_k: bool = False  # False: pick k <= K each step from measured step times and acceptance
    batch_size: int = 8  # sequences decoded together; free slots are refilled from the waiting requests
    strict: bool = False  # costly invariant checks (probabilities sum to 1, shapes); tests switch it on
    probe_interval: int = 16  # adaptive k: every this many steps try a neighbouring k, to keep estimates fresh
    # exact: modified rejection sampling (decoding/rejection.py); reproducible: the coupled exponential race
    # (decoding/sampling.py), where a seeded request's tokens do not depend on the batch, k or the draft.
    # The default: it costs 2-3 points of acceptance and no measurable tokens/s on the demo pair
    # (docs/benchmark-log/2026-12.md, "Sampling modes: what `--sampling reproducible` costs"), and a batch
    # system's retries and audits need a seed to mean one output.
    sampling: SamplingMode = "reproducible"
    # a model-free proposer (decoding/model_free.py), alone or, with a draft model, beside it per row
    model_free: ModelFree | None = None
    # rows, KV capacity and draft catch-ups in a few sizes, attention over the whole capacity, prefill
    # eager (decoding/static_shapes.py): what CUDA graphs need, and always on where a model was compiled
    # with them; elsewhere it only pads work
    static_shapes: bool = False

    def __post_init__(self) -> None:
        if self.draft_model_depth is None:
            given = self.num_speculative_tokens
            object.__setattr__(self, "draft_model_depth", DRAFT_MODEL_SPECULATIVE_TOKENS if given is None else given)
        if self.num_speculative_tokens is None:
            default = DRAFT_MODEL_SPECULATIVE_TOKENS
            if self.model_free is not None:
                few_rows = self.batch_size <= MODEL_FREE_FEW_ROWS
                default = MODEL_FREE_FEW_ROWS_SPECULATIVE_TOKENS if few_rows else MODEL_FREE_SPECULATIVE_TOKENS
            object.__setattr__(self, "num_speculative_tokens", default)
        NUM_SPECULATIVE_TOKENS.check("num_speculative_tokens", self.num_speculative_tokens)
        lowest_depth = min(1, self.num_speculative_tokens)
        if not lowest_depth <= self.draft_model_depth <= self.num_speculative_tokens:
            raise ValueError(
                f"draft_model_depth must be in [{lowest_depth}, num_speculative_tokens = "
                f"{self.num_speculative_tokens}], got {self.draft_model_depth}"
            )
        BATCH_SIZE.check("batch_size", self.batch_size)
        if self.probe_interval < 2:
            raise ValueError(f"probe_interval must be >= 2, got {self.probe_interval}")
        if self.sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLING_MODES)}, got {self.sampling!r}")
        if self.model_free is not None and self.model_free not in MODEL_FREE:
            raise ValueError(f"model_free must be one of {', '.join(MODEL_FREE)}, got {self.model_free!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def policy_key(self, target: str, draft: str | None, dtype: str | None) -> PolicyKey:
        """Which engines may share an adaptive-k policy (decoding/k_policy.py), so what it measured carries
        over from batch to batch: those on the same models (step times are theirs) that choose k under
        the same K, mode and model-free proposer (acceptance is the proposers'). Batch size is not in it:
        the policy times each row count apart."""
        return (target, draft, dtype, self.num_speculative_tokens, self.fixed_k, self.model_free)
