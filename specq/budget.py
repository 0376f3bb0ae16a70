"""How much to train a draft, as people write it: tokens (`200k`, `2M`) or a training time (`30m`).
Plain data, below every part: `specq draft train --budget` and a job's `--draft train:N:BUDGET` parse
through here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from specq.durations import parse_duration

# far past any run (a GPU training a million tokens a second would take 30 years), and a float holds it exactly
MOST_TOKENS = 10**15


@dataclass(frozen=True)
class Budget:
    """How much training: `tokens` (positions whose target distribution the draft is trained on) or
    `seconds` of training wall time (the target's decoding not counted); exactly one is set."""

    tokens: int | None = None
    seconds: float | None = None

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.seconds is None):
            raise ValueError("a budget is tokens or seconds, exactly one")
        if (self.tokens is not None and self.tokens < 1) or (self.seconds is not None and self.seconds <= 0):
            raise ValueError("a budget must be positive")

    @classmethod
    def parse(cls, text: str) -> Budget:
        """`200000` or `200k` or `2M` (tokens, optionally followed by `tokens`), or a duration (`90s`, `30m`,
        `1h`: training time); ValueError with a sentence otherwise."""
        value = str(text).strip()
        match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKM]?)\s*(?:tokens?)?", value)
        if match:
            tokens = float(match.group(1)) * {"": 1, "k": 1e3, "K": 1e3, "M": 1e6}[match.group(2)]
            if tokens > MOST_TOKENS:  # a thousand digits reads as infinity, which no int holds
                raise ValueError(f"a budget is at most {MOST_TOKENS:,} tokens")
            if tokens >= 1:
                return cls(tokens=int(tokens))
        try:
            return cls(seconds=parse_duration(value).total_seconds())
        except ValueError:
            raise ValueError(
                f"{text!r} is not a budget: give training tokens (e.g. 200000, 200k, 2M) or a duration "
                "(e.g. 90s, 30m, 1h)"
            ) from None

    def describe(self) -> str:
        return f"{self.tokens} tokens" if self.tokens is not None else f"{self.seconds:g}s"
