"""The training data: the prompts of the job file, split into training and held-out prompts, and the
target's own completions of the training prompts, decoded by specq's engine with the target alone.

Training on the target's outputs (not on a dataset's) is what DistillSpec (Zhou et al. 2024) found to
raise acceptance most: the draft learns the target where the target will be asked to go."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specq.decoding.types import GenerationRequest, GenerationResult
from specq.errors import BadInputError, SpecqError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specq.decoding.stats import EngineStats
    from specq.jobs.inputs import RequestSpec

DecodeProgress = Callable[[int, int, "EngineStats"], None]  # (decoded, total, the engine's counters)


@dataclass(frozen=True)
class Prompt:
    """One prompt of the file, tokenized as the engine gets it, with its sampling settings resolved."""

    line: int
    request: GenerationRequest


@dataclass(frozen=True)
class Decoded:
    """A training sequence: the prompt, then the target's completion of it."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.prompt + self.completion


def prepare_prompts(
    specs: Iterator[RequestSpec],
    tokenizer: PreTrainedTokenizerBase,
    sampling: dict[str, Any],
    chat_template: str | None,
    name: str,
) -> list[Prompt]:
    """Every validated line as an engine request (a line with `n` > 1 counts once: the draft learns from
    one completion of it). Lines that cannot be prepared (a chat template that fails to render) are
    reported together as bad lines of `name`: the training data would silently lose them otherwise."""
    from specq.jobs.params import engine_request

    prompts, problems = [], []
    for key, spec in enumerate(specs):
        request = engine_request(key, spec, tokenizer, sampling, chat_template)
        if isinstance(request, GenerationResult):
            problems.append(f"{name}:{spec.line}: {request.error}")
        else:
            prompts.append(Prompt(spec.line, request))
    if problems:
        raise BadInputError(problems)
    return prompts


def split(count: int, heldout: int, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices) of `count` prompts, `heldout` of them drawn at random with
    `seed`; both in file order."""
    chosen = set(random.Random(seed).sample(range(count), heldout))
    return [i for i in range(count) if i not in chosen], sorted(chosen)


def decode_with_target(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    batch_size: int,
    on_progress: DecodeProgress = lambda done, total, stats: None,
) -> list[Decoded]:
    """The target's completion of each prompt (specq's batched engine, target-only, each request's own
    sampling settings), in the prompts' order."""
    from specq.decoding.config import DecodingConfig
    from specq.decoding.engine import SpeculativeEngine

    engine = SpeculativeEngine(target, tokenizer, None, DecodingConfig(batch_size=batch_size))
    requests = [
        GenerationRequest(i, prompt.request.prompt_token_ids, prompt.request.params) for i, prompt in enumerate(prompts)
    ]
    completions: dict[int, tuple[int, ...]] = {}
    for result in engine.generate(requests):
        if result.error is not None:
            raise SpecqError(f"the target failed on line {prompts[result.key].line}: {result.error}")
        completions[result.key] = tuple(result.token_ids)
        on_progress(len(completions), len(requests), engine.stats)
    return [Decoded(request.prompt_token_ids, completions[i]) for i, request in enumerate(requests)]


def save_sequences(path: Path, sequences: Sequence[Decoded]) -> None:
    """Written whole, then renamed into place: a file that is there is complete."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as out:
        for sequence in sequences:
            out.write(json.dumps({"prompt": list(sequence.prompt), "completion": list(sequence.completion)}) + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)


def load_sequences(path: Path) -> list[Decoded]:
    with open(path, encoding="utf-8") as lines:
        return [Decoded(tuple(row["prompt"]), tuple(row["completion"])) for row in map(json.loads, lines)]
