"""The engine's inputs and outputs: plain data, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded. Temperature 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 1.0  # the OpenAI default
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # None: the engine draws one, and reports it
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt, already tokenized. `key` is the caller's handle, echoed in the result."""

    key: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)


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
    error: str | None = None

    @classmethod
    def failed(cls, key: int, error: str, prompt_tokens: int = 0) -> GenerationResult:
        """The result of a request that ended with `error` and no completion: the one way to fail one."""
        return cls(key, [], "", None, prompt_tokens, 0, error=error)
