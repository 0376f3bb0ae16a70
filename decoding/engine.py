"""PLACEHOLDER: being written now. Interface is fixed:

class SpeculativeEngine:
    def __init__(self, target, tokenizer, draft=None, config=DecodingConfig()) -> None
    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[GenerationResult]
        # pulls requests lazily (flat memory), yields results in completion order (match by .key)
    stats: EngineStats   # cumulative counters since construction / reset_stats()
    def reset_stats(self) -> None
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from decoding.config import DecodingConfig
from decoding.stats import EngineStats
from decoding.types import GenerationRequest, GenerationResult


class SpeculativeEngine:
    def __init__(self, target, tokenizer, draft=None, config: DecodingConfig = DecodingConfig()) -> None:
        self.target, self.tokenizer, self.draft, self.config = target, tokenizer, draft, config
        self.stats = EngineStats()

    def reset_stats(self) -> None:
        self.stats = EngineStats()

    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[GenerationResult]:
        raise NotImplementedError
