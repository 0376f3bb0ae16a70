"""Which waiting requests take a batch's free rows. Each is checked against the models first: one that
cannot be decoded (a prompt past the context, ids outside the vocabulary) fails alone, with its result,
and takes no row. Requests are read lazily, as rows free up, so memory stays flat however many wait."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from specq.decoding.types import GenerationRequest, GenerationResult


@dataclass(frozen=True)
class RequestIntake:
    max_context: int  # tokens a row may hold: the shorter context of the two models
    vocab_size: int  # the target's, whose every id a prompt may hold
    start_token_id: int | None  # where an empty prompt starts from; None: the tokenizer has no BOS or EOS

    def take(
        self, waiting: Iterator[GenerationRequest], free: int
    ) -> tuple[list[GenerationRequest], list[GenerationResult], bool]:
        """Up to `free` valid requests, the failures of invalid ones, and whether the requests ran out."""
        admitted: list[GenerationRequest] = []
        failures: list[GenerationResult] = []
        while len(admitted) < free:
            request = next(waiting, None)
            if request is None:
                return admitted, failures, True
            request = self._with_start_token(request)
            problem = self._problem(request)
            if problem:
                failures.append(GenerationResult.failed(request.key, problem, len(request.prompt_token_ids)))
            else:
                admitted.append(request)
        return admitted, failures, False

    def _with_start_token(self, request: GenerationRequest) -> GenerationRequest:
        if request.prompt_token_ids or self.start_token_id is None:
            return request
        return GenerationRequest(request.key, (self.start_token_id,), request.params)

    def _problem(self, request: GenerationRequest) -> str | None:
        prompt_len, max_tokens = len(request.prompt_token_ids), request.params.max_tokens
        if prompt_len == 0:
            return "empty prompt, and the tokenizer has no BOS or EOS token to start from"
        if prompt_len + max_tokens > self.max_context:
            return (
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                f"context of {self.max_context} tokens"
            )
        # the target reads every prompt id; the draft reads the ids it cannot take as another
        if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= self.vocab_size:
            return f"prompt has token ids outside the vocabulary [0, {self.vocab_size})"
        return None
