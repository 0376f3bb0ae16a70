"""`specq run`: generate for a JSONL file in this process, no queue and no database.

The file is validated whole first (nothing is generated for a file with bad lines), then streamed
through the engine: requests are tokenized as the engine pulls them, and results are written in
input order as soon as every earlier line is written, so memory stays flat in the file's length.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specq.decoding.config import DecodingConfig
from specq.decoding.stats import EngineStats
from specq.decoding.types import GenerationRequest, GenerationResult
from specq.jobs.inputs import InputLimits, iter_request_specs, validate_file
from specq.jobs.output_file import open_output
from specq.jobs.outputs import result_record
from specq.jobs.params import engine_request

log = logging.getLogger(__name__)


@dataclass
class RunSummary:
    total: int
    completed: int = 0
    failed: int = 0
    stats: EngineStats = field(default_factory=EngineStats)


Progress = Callable[[int, EngineStats], None]  # (requests written so far, engine counters)


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
    on_start: Callable[[int], None] = lambda total: None,
    on_progress: Progress = lambda done, stats: None,
    limits: InputLimits | None = None,
) -> RunSummary:
    """Generate for every line of `input_path` and write one JSON line per request to `output_path`
    ("-": stdout), as jobs.output_file writes: nothing is written, and an existing file is left as it
    was, unless the whole input is good and the run ends."""
    from specq.models.loading import load_pair, resolve_device

    total = validate_file(input_path, limits)
    with open_output(output_path) as output:
        on_start(total)
        pair = load_pair(target, draft, resolve_device(device), dtype)
        from specq.decoding.engine import SpeculativeEngine

        engine = SpeculativeEngine(pair.target, pair.tokenizer, pair.draft, decoding)
        summary = RunSummary(total=total, stats=engine.stats)
        ids: dict[int, str] = {}  # key -> request id, for lines not yet written
        early_failures: dict[int, GenerationResult] = {}

        def requests() -> Iterator[GenerationRequest]:
            for key, spec in enumerate(iter_request_specs(input_path, limits)):
                ids[key] = spec.id
                request = engine_request(key, spec, pair.tokenizer, sampling)
                if isinstance(request, GenerationResult):
                    early_failures[key] = request
                else:
                    yield request

        waiting: dict[int, GenerationResult] = {}
        next_key = 0

        def flush() -> None:
            nonlocal next_key
            while True:
                result = waiting.pop(next_key, None) or early_failures.pop(next_key, None)
                if result is None:
                    return
                output.write(json.dumps(result_record({"id": ids.pop(next_key)}, result, with_tokens=True)) + "\n")
                if result.error is None:
                    summary.completed += 1
                else:
                    summary.failed += 1
                    log.info("request %s failed: %s", result.key, result.error)
                next_key += 1

        for result in engine.generate(requests()):
            waiting[result.key] = result
            flush()
            on_progress(next_key, engine.stats)
        flush()  # failures after the last generated request
        on_progress(next_key, engine.stats)
        summary.stats = engine.stats
        return summary


def default_output_path(input_path: str) -> Path:
    path = Path(input_path)
    return path.with_name(path.stem + ".out.jsonl")
