"""The training data: the prompts of the job file, split into training and held-out prompts, and the
target's own completions of the training prompts, decoded by specq's engine with the target alone.

Training on the target's outputs (not on a dataset's) is what DistillSpec (Zhou et al. 2024) found to
raise acceptance most: the draft learns the target where the target will be asked to go."""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Callable, Collection, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specq.decoding.types import GenerationRequest, GenerationResult, SamplingParams
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
    """A training sequence: the prompt, then the target's completion of it, and (where the decode kept
    them) the target's likeliest next tokens at each completion token's position: the token itself and
    the top alternatives, `top_k` + 1 ids and raw log-probabilities a token, padded with id 0 and -inf
    where the token was among the alternatives."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    top_ids: tuple[tuple[int, ...], ...] | None = None  # [completion, top_k + 1]
    top_logprobs: tuple[tuple[float, ...], ...] | None = None  # [completion, top_k + 1]

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.prompt + self.completion


def prepare_prompts(
    specs: Iterator[RequestSpec],
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingParams,
    name: str,
) -> list[Prompt]:
    """Every validated line as an engine request (a line with `n` > 1 counts once: the draft learns from
    one completion of it). Lines that cannot be prepared (a chat template that fails to render) are
    reported together as bad lines of `name`: the training data would silently lose them otherwise."""
    from specq.jobs.params import engine_request

    prompts, problems = [], []
    for key, spec in enumerate(specs):
        request = engine_request(key, spec, tokenizer, asdict(sampling))
        if isinstance(request, GenerationResult):
            problems.append(f"{name}:{spec.line}: {request.error}")
        else:
            prompts.append(Prompt(spec.line, request))
    if problems:
        raise BadInputError(problems)
    return prompts


def check_within_context(prompts: Sequence[Prompt], max_context: int, name: str) -> None:
    """BadInputError naming every prompt that, with its completion, cannot fit the target's context, as
    `file:line: reason` in the engine's words (decoding/intake.py): caught with the other bad lines,
    before anything is written, where the engine would fail it half-way through the decode."""
    problems = [
        f"{name}:{prompt.line}: prompt ({len(prompt.request.prompt_token_ids)} tokens) plus max_tokens "
        f"({prompt.request.params.max_tokens}) exceeds the model's context of {max_context} tokens"
        for prompt in prompts
        if len(prompt.request.prompt_token_ids) + prompt.request.params.max_tokens > max_context
    ]
    if problems:
        raise BadInputError(problems)


def split(count: int, heldout: int, seed: int) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices) of `count` prompts, `heldout` of them drawn at random with
    `seed`; both in file order."""
    chosen = set(random.Random(seed).sample(range(count), heldout))
    return [i for i in range(count) if i not in chosen], sorted(chosen)


class DecodeStore:
    """The completions decoded so far, in a file that grows by one line as the engine finishes each (in
    whatever order): what a rerun need not decode again. A kill mid-write leaves a torn last line: it
    is dropped on opening (the file cut after the last whole line), and its prompt decoded again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.decoded: dict[int, Decoded] = {}  # by prompt index
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        kept = 0
        *lines, _torn = data.split(b"\n")
        for line in lines:
            try:
                row = json.loads(line)
                self.decoded[int(row["index"])] = _from_row(row)
            except (ValueError, KeyError, TypeError):
                break
            kept += len(line) + 1
        if kept < len(data):
            os.truncate(path, kept)

    def append(self, index: int, sequence: Decoded) -> None:
        # opened, written and closed a completion: a kill keeps every line written before it
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(_line({"index": index, **asdict(sequence)}))


def decode_with_target(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    batch_size: int,
    top_k: int = 0,
    on_progress: DecodeProgress = lambda done, total, stats: None,
    store: DecodeStore | None = None,
    wanted: Collection[int] | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> list[Decoded]:
    """The target's completion of each prompt (specq's batched engine, target-only, each request's own
    sampling settings), in the prompts' order; with `top_k` > 0, with the target's `top_k` likeliest
    tokens at each position (the engine's logprobs, read as it verifies: no extra forward). With a
    `store`, each completion goes into it as the engine finishes it, and the prompts it already holds are
    not decoded again (`on_progress` counts the others). `wanted`: those prompts alone (positions in
    `prompts`), decoded and returned. `stop`, asked after each completion, ends the decode where it says
    so (a time limit): the completions under way are dropped, those finished returned."""
    from specq.decoding.config import DecodingConfig
    from specq.decoding.engine import SpeculativeEngine

    decoded = dict(store.decoded) if store is not None else {}
    chosen = range(len(prompts)) if wanted is None else sorted(wanted)
    engine = SpeculativeEngine(target, tokenizer, None, DecodingConfig(batch_size=batch_size))
    requests = [
        GenerationRequest(
            i, prompts[i].request.prompt_token_ids, replace(prompts[i].request.params, logprobs=top_k or None)
        )
        for i in chosen
        if i not in decoded
    ]
    results = engine.generate(requests)
    try:
        for done, result in enumerate(results, 1):
            if result.error is not None:
                raise SpecqError(f"the target failed on line {prompts[result.key].line}: {result.error}")
            sequence = _decoded(prompts[result.key].request.prompt_token_ids, result, top_k)
            decoded[result.key] = sequence
            if store is not None:
                store.append(result.key, sequence)
            on_progress(done, len(requests), engine.stats)
            if done < len(requests) and stop():
                break
    finally:
        if isinstance(results, Generator):  # closed at a stop: the engine lets its rows and caches go now
            results.close()
    return [decoded[i] for i in chosen if i in decoded]


def _decoded(prompt: tuple[int, ...], result: GenerationResult, top_k: int) -> Decoded:
    if not top_k:
        return Decoded(prompt, tuple(result.token_ids))
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    ids, values = [], []
    for entry in result.logprobs:
        pairs = {token_id: logprob for token_id, _, logprob in entry.top[:top_k]}
        pairs.setdefault(entry.token_id, entry.logprob)
        padding = top_k + 1 - len(pairs)
        ids.append((*pairs, *[0] * padding))
        values.append((*pairs.values(), *[-math.inf] * padding))
    return Decoded(prompt, tuple(result.token_ids), tuple(ids), tuple(values))


def save_sequences(path: Path, sequences: Sequence[Decoded]) -> None:
    """Written whole, then renamed into place: a file that is there is complete."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as out:
        for sequence in sequences:
            out.write(_line(asdict(sequence)))
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)


def _line(row: dict[str, Any]) -> str:
    return json.dumps(row) + "\n"  # -inf as -Infinity, which json reads back


def load_sequences(path: Path) -> list[Decoded]:
    with open(path, encoding="utf-8") as lines:
        return [_from_row(row) for row in map(json.loads, lines)]


def _from_row(row: dict[str, Any]) -> Decoded:
    def rows(values: list[list[Any]] | None) -> tuple[tuple[Any, ...], ...] | None:
        return None if values is None else tuple(map(tuple, values))

    return Decoded(tuple(row["prompt"]), tuple(row["completion"]), rows(row["top_ids"]), rows(row["top_logprobs"]))
