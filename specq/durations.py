"""Spans of time as people write them: a number and a unit, `90s`, `30m`, `24h`, `7d`, `2w` (OpenAI's
completion window is written `24h`). Plain data: the CLI's option type and the environment's settings
both parse through here."""

from __future__ import annotations

import math
from datetime import timedelta

LONGEST = timedelta(days=1000 * 365)  # past this, dates before it underflow a datetime
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}  # seconds in each


def parse_duration(text: str) -> timedelta:
    """The span `text` names; ValueError with a sentence if it names none."""
    value = str(text).strip().lower()
    number, unit = value[:-1], value[-1:]
    try:
        amount = float(number) if unit in UNITS else math.nan
    except ValueError:
        amount = math.nan
    if not math.isfinite(amount) or amount <= 0 or amount * UNITS[unit] > LONGEST.total_seconds():
        raise ValueError(
            f"{text!r} is not a duration: give a positive number and a unit, e.g. 30m, 24h or 7d (1000 years at most)"
        )
    return timedelta(seconds=amount * UNITS[unit])
