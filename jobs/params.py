"""From stored settings to the engine's inputs: a job's DecodingConfig, a request's SamplingParams.

`specq run` and the queue both go through here, so the same line decodes the same way in both.
A line's overrides win over the job's defaults, which win over SamplingParams' own defaults.
"""

from __future__ import annotations

from typing import Any

from specq.decoding.config import DecodingConfig
from specq.decoding.types import SamplingParams

SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def sampling_params(defaults: dict[str, Any], overrides: dict[str, Any]) -> SamplingParams:
    """The request's SamplingParams: `overrides` (the line's) over `defaults` (the job's)."""
    merged = {k: v for k, v in defaults.items() if k in SAMPLING_KEYS and v is not None}
    merged.update((k, v) for k, v in overrides.items() if v is not None)
    if "stop" in merged:
        merged["stop"] = tuple(merged["stop"])  # stored as a JSON list
    return SamplingParams(**merged)


def decoding_config(settings: dict[str, Any]) -> DecodingConfig:
    """The job's DecodingConfig from its stored settings (unknown keys from newer versions ignored)."""
    stored = settings.get("decoding", {})
    known = DecodingConfig.__dataclass_fields__.keys()
    return DecodingConfig(**{k: v for k, v in stored.items() if k in known})
