"""`specq run`: generate for a JSONL file in this process, no queue and no database.

The file is validated whole first (nothing is generated for a file with bad lines), then streamed
through the engine: requests are tokenized as the engine pulls them, and results are written in
input order as soon as every earlier line is written, so memory stays flat in the file's length.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from specq.decoding.config import DecodingConfig
from specq.decoding.stats import EngineStats
from specq.decoding.types import GenerationRequest, GenerationResult
from specq.jobs.chat_template import ChatLines
from specq.jobs.input_source import STDIN, readable_input
from specq.jobs.inputs import InputLimits, iter_request_specs, validate_file
from specq.jobs.output_file import open_output
from specq.jobs.outputs import OpenAIIds, openai_record, result_record, served_name
from specq.jobs.params import choice_overrides, engine_request

log = logging.getLogger(__name__)

OutputFormat = Literal["jsonl", "openai"]


@dataclass
class RunSummary:
    total: int  # requests: a line with `n` > 1 is n of them
    lines: int = 0  # input lines generated for
    completed: int = 0
    failed: int = 0
    stats: EngineStats = field(default_factory=EngineStats)


Progress = Callable[[int, int, EngineStats], None]  # (requests written so far, of them failed, engine counters)


def run_file(
    input_path: str,
    output_path: str,
    *,
    target: str,
    draft: str | None,
    decoding: DecodingConfig,
    sampling: dict[str, Any],
    device: str | None,
    dtype: str | None,
    chat_template: str | None = None,
    served_model_name: str | None = None,
    output_format: OutputFormat = "jsonl",
    compile: str = "off",
    on_start: Callable[[int], None] = lambda total: None,
    on_loaded: Callable[[str], None] = lambda line: None,
    on_progress: Progress = lambda done, failed, stats: None,
    limits: InputLimits | None = None,
) -> RunSummary:
    """Generate for every line of `input_path` ("-": stdin) and write one JSON line per request to
    `output_path` ("-": stdout), as jobs.output_file writes: nothing is written, and an existing file is
    left as it was, unless the whole input is good and the run ends. Chat lines are rendered with
    `chat_template`, else the target tokenizer's own, under the bounds of jobs.chat_render; a line that
    cannot be rendered is a bad line. They are rendered twice, when the input is checked and when it
    runs: a run keeps no line in memory.

    `output_format` "openai": the lines are OpenAI Batch output lines, whose `model` is
    `served_model_name`, else the line's `body.model`, else the target's name (as `export` writes them)."""
    from specq.models.loading import load_pair, load_tokenizer, resolve_device

    with ExitStack() as cleanup:  # the spool (if any) outlives the output, which is renamed into place first
        source = cleanup.enter_context(readable_input(input_path, limits))
        chat_lines = cleanup.enter_context(ChatLines(target, chat_template, functools.cache(load_tokenizer)))
        total = validate_file(source.path, limits, name=source.name, prepare=chat_lines)
        output = cleanup.enter_context(open_output(output_path))
        on_start(total)
        pair = load_pair(
            target,
            draft,
            resolve_device(device),
            dtype,
            compile,
            first_rows=max(1, min(decoding.batch_size, total)),
            measure_at_load=False,  # after the run, below: the first tokens wait for no measurement
        )
        compile_line = pair.compile_line()
        if compile_line is not None:
            on_loaded(compile_line)  # what --compile did, before the first token
        from specq.decoding.engine import SpeculativeEngine

        engine = SpeculativeEngine(pair.target, pair.tokenizer, pair.draft, decoding)
        summary = RunSummary(total=total, stats=engine.stats)
        # key -> the request's id, kind, model, choice and n; for requests not yet written. A line with
        # `n` > 1 is n requests (its choices), at consecutive keys
        requests_of: dict[int, dict[str, Any]] = {}
        record = _record_writer(output_format, served_model_name or None, target)
        early_failures: dict[int, GenerationResult] = {}

        def requests() -> Iterator[GenerationRequest]:
            key = 0
            for spec in iter_request_specs(source.path, limits, name=source.name, prepare=chat_lines):
                summary.lines += 1
                for choice in range(spec.n):
                    requests_of[key] = {
                        "id": spec.id,
                        "kind": spec.kind,
                        "model": spec.model,
                        "choice": choice,
                        "n": spec.n,
                    }
                    line = replace(spec, overrides=choice_overrides(spec.overrides, choice))
                    request = engine_request(key, line, pair.tokenizer, sampling)
                    if isinstance(request, GenerationResult):
                        early_failures[key] = request
                    else:
                        yield request
                    key += 1

        waiting: dict[int, GenerationResult] = {}
        next_key = 0

        def flush() -> None:
            nonlocal next_key
            while True:
                result = waiting.pop(next_key, None) or early_failures.pop(next_key, None)
                if result is None:
                    return
                line = record(next_key, requests_of.pop(next_key), result)
                if line is not None:
                    output.write(json.dumps(line, ensure_ascii=False) + "\n")
                if result.error is None:
                    summary.completed += 1
                else:
                    summary.failed += 1
                    log.info("request %s failed: %s", result.key, result.error)
                next_key += 1

        for result in engine.generate(requests()):
            waiting[result.key] = result
            flush()
            on_progress(next_key, summary.failed, engine.stats)
        flush()  # failures after the last generated request
        on_progress(next_key, summary.failed, engine.stats)
        summary.stats = engine.stats
    # the output is in place: what the compiled forwards gain is measured now, where it was not before
    measured = pair.measure_compiled_speedups()
    if measured is not None:
        on_loaded(measured)
    return summary


def _record_writer(
    output_format: OutputFormat, served_model_name: str | None, target: str
) -> Callable[[int, dict[str, Any], GenerationResult], dict | None]:
    """(position, request, result), in order -> the output line to write, or None while a line with
    `n` > 1 waits for its other choices. jsonl: a line a choice (with its `choice` when n > 1); openai:
    a line an input line, its choices together."""
    if output_format == "jsonl":
        return lambda position, request, result: result_record(
            request, result, with_tokens=True, choice=request["choice"] if request["n"] > 1 else None
        )
    scope, default_model = uuid.uuid4().hex, served_name(target)  # ids unique to this run's file
    choices: list[GenerationResult] = []

    def openai_line(position: int, request: dict[str, Any], result: GenerationResult) -> dict | None:
        choices.append(result)
        if request["choice"] < request["n"] - 1:
            return None
        first, *more = choices
        choices.clear()
        model = served_model_name or request["model"] or default_model
        ids = OpenAIIds.derive(scope, position - request["choice"])
        return openai_record(request, first, model=model, ids=ids, more=more)

    return openai_line


def default_output_path(input_path: str) -> str:
    """INPUT.out.jsonl beside the input; standard output for standard input."""
    if input_path == STDIN:
        return STDIN
    path = Path(input_path)
    return str(path.with_name(path.stem + ".out.jsonl"))
