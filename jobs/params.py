"""From a job's settings to the engine's inputs: a request's SamplingParams and the engine request itself
(`engine_request`); the job's own settings are `jobs.settings.JobSettings`.

`specq run` and the queue both go through here, so the same line decodes the same way in both.
A line's overrides win over the job's defaults, which win over SamplingParams' own defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from specq.decoding.types import SAMPLING_KEYS, GenerationRequest, GenerationResult, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from specq.jobs.chat_render import ChatTokens


def sampling_params(defaults: dict[str, Any], overrides: dict[str, Any]) -> SamplingParams:
    """The request's SamplingParams: `overrides` (the line's) over `defaults` (the job's)."""
    merged = {k: v for k, v in defaults.items() if k in SAMPLING_KEYS and v is not None}
    merged.update((k, v) for k, v in overrides.items() if v is not None)
    if "stop" in merged:
        merged["stop"] = tuple(merged["stop"])  # stored as a JSON list
    return SamplingParams(**merged)


# the golden ratio's 64-bit constant, as splitmix64 steps: seeds of a line's choices land far apart
_CHOICE_SEED_STEP = 0x9E3779B97F4A7C15


def choice_overrides(overrides: dict[str, Any], choice: int) -> dict[str, Any]:
    """The overrides of choice `choice` of a line with `n` > 1: a seeded line's choice i decodes with
    seed (seed + i * 0x9E3779B97F4A7C15) mod 2**63, so the choices differ and the whole line stays
    reproducible; choice 0 keeps the line's own seed (a line with n = 1 is unchanged)."""
    if choice == 0 or overrides.get("seed") is None:
        return overrides
    return {**overrides, "seed": (overrides["seed"] + choice * _CHOICE_SEED_STEP) % 2**63}


class PromptLine(Protocol):
    """A request as a line of input (`jobs.inputs.RequestSpec`) or as stored (`worker.claims.ClaimedRequest`)."""

    @property
    def prompt(self) -> str | None: ...  # set for completion requests

    @property
    def messages(self) -> list[dict[str, Any]] | None: ...  # set for chat requests

    @property
    def prompt_token_ids(self) -> Sequence[int] | None: ...  # given as ids, or chat messages once rendered

    @property
    def overrides(self) -> dict[str, Any]: ...  # the line's own sampling settings


def engine_request(
    key: int,
    line: PromptLine,
    tokenizer: PreTrainedTokenizerBase,
    defaults: dict[str, Any],
    chat: ChatTokens | None = None,
) -> GenerationRequest | GenerationResult:
    """The engine request for one line: its prompt token ids (as given, as rendered at submit, or its
    text tokenized), its sampling settings resolved over the job's `defaults`. Chat messages with no
    token ids (a job stored before chat lines were rendered at submit) are rendered by `chat`, under its
    bounds. A line that cannot be prepared fails alone: its failed result is returned."""
    from specq.models.loading import tokenize_prompt

    try:
        params = sampling_params(defaults, line.overrides)
        if line.prompt_token_ids is not None:
            prompt_ids = _in_vocabulary(line.prompt_token_ids, len(tokenizer))
        elif line.messages is not None:
            if chat is None:
                raise ValueError("chat messages, and no chat template to render them with")
            prompt_ids = chat.token_ids(line.messages)
        else:
            prompt_ids = tokenize_prompt(tokenizer, prompt=line.prompt)
    except Exception as exc:  # a chat template that fails to render, settings out of range, ...
        return GenerationResult.failed(key, f"cannot prepare the request: {exc}")
    return GenerationRequest(key, tuple(prompt_ids), params)


def _in_vocabulary(token_ids: Sequence[int], vocabulary: int) -> Sequence[int]:
    """Prompt token ids as given, once each is known to be a token of the tokenizer."""
    outside = next((token for token in token_ids if not 0 <= token < vocabulary), None)
    if outside is not None:
        raise ValueError(f"prompt token id {outside} is outside the tokenizer's vocabulary of {vocabulary}")
    return token_ids
