"""The engine's inputs and outputs: plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from specq.limits import (
    LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_TOKENS,
    MIN_SAMPLING_TEMPERATURE,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
)

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Greedy at temperature 0 and below MIN_SAMPLING_TEMPERATURE (`greedy`)."""

    max_tokens: int = 128
    temperature: float = 1.0  # the OpenAI default
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # None: the engine draws one, and reports it
    stop: tuple[str, ...] = ()
    # None: no log-probabilities; N: each output token's own and its N most likely alternatives
    logprobs: int | None = None

    def __post_init__(self) -> None:
        MAX_TOKENS.check("max_tokens", self.max_tokens)
        TEMPERATURE.check("temperature", self.temperature)
        TOP_P.check("top_p", self.top_p)
        TOP_K.check("top_k", self.top_k)
        if self.seed is not None:
            SEED.check("seed", self.seed)
        if self.logprobs is not None:
            LOGPROBS.check("logprobs", self.logprobs)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily: the one rule, which every path asks (vLLM's `sampling_type`).

        A positive temperature below specq.limits.MIN_SAMPLING_TEMPERATURE is greedy too: the logits
        divided by it overflow, and its distribution is all but one-hot anyway."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE


# The settings a line, or a job's defaults, set by name: every field of SamplingParams but `logprobs`,
# which asks for a report rather than a way to sample (a line asks for it in its own forms, OpenAI's
# `logprobs`/`top_logprobs`, and a job never does)
SAMPLING_KEYS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams) if f.name != "logprobs")


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt, already tokenized. `key` is the caller's handle, echoed in the result."""

    key: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the target (its raw log-softmax: before temperature,
    top-k and top-p, as OpenAI reports them), and its `top` alternatives, most likely first."""

    token_id: int
    token: str  # the token decoded alone (a partial UTF-8 character decodes to U+FFFD)
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, token, logprob)

    def to_dict(self) -> dict:
        return {
            "token_id": self.token_id,
            "token": self.token,
            "logprob": self.logprob,
            "top": [list(entry) for entry in self.top],
        }


@dataclass
class GenerationResult:
    """What the engine returns for one request: a completion, or an error that failed it alone."""

    key: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int = 0  # draft tokens proposed for this request
    accepted_tokens: int = 0  # of those, kept by the target
    seed: int | None = None
    latency_s: float = 0.0
    first_token_s: float | None = None  # from admission to the first output token (None: no token)
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked

    @classmethod
    def failed(cls, key: int, error: str, prompt_tokens: int = 0) -> GenerationResult:
        """The result of a request that ended with `error` and no completion: the one way to fail one."""
        return cls(key, [], "", None, prompt_tokens, 0, error=error)
