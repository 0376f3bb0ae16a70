"""Batched speculative decoding in plain torch: no Celery, Redis or database in here.

The names below load on first use, so `from decoding.config import DecodingConfig` (the CLI, the
queue) does not import torch and the engine.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "DecodingConfig": "specq.decoding.config",
    "EngineStats": "specq.decoding.stats",
    "FinishReason": "specq.decoding.types",
    "GenerationRequest": "specq.decoding.types",
    "GenerationResult": "specq.decoding.types",
    "SamplingParams": "specq.decoding.types",
    "SpeculativeEngine": "specq.decoding.engine",
}

__all__ = [
    "DecodingConfig",
    "EngineStats",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "SamplingParams",
    "SpeculativeEngine",
]

if TYPE_CHECKING:
    from specq.decoding.config import DecodingConfig
    from specq.decoding.engine import SpeculativeEngine
    from specq.decoding.stats import EngineStats
    from specq.decoding.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'decoding' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
