"""Batched speculative decoding in plain torch: no Celery, Redis or database in here."""

from decoding.config import DecodingConfig
from decoding.engine import SpeculativeEngine
from decoding.stats import EngineStats
from decoding.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams

__all__ = [
    "DecodingConfig",
    "EngineStats",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "SamplingParams",
    "SpeculativeEngine",
]
