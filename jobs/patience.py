"""Commands that read the database (`submit --wait`, `status`, `export`, `workers`) ride out a restart of
it, as the workers do (issue 14, item 11).

A read that meets a lost or refused connection is tried again with exponential backoff (0.5 s, doubling,
at most 5 s apart; tenacity) for up to SPECQ_OUTAGE_PATIENCE_S seconds (30 by default: a PostgreSQL
restart takes a few). The first failure of an outage prints one warning line; the command then goes
on to its normal result. An outage that outlasts the patience ends the command with one line
(ServiceUnavailableError: exit 1), never a traceback.

Only reads are retried: each is one statement or one short transaction, so a retry repeats nothing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.exc import InterfaceError, OperationalError
from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_delay, wait_exponential

from specq.db.session import refusal
from specq.errors import ConfigError, DatabaseUnreachableError, ServiceUnavailableError

T = TypeVar("T")
PATIENCE_ENV = "SPECQ_OUTAGE_PATIENCE_S"
DEFAULT_PATIENCE_S = 30.0
# a connection lost mid-read (OperationalError, InterfaceError), or none to be had at all; a server that
# refuses for good (no such database, authentication failed: db.session.refusal) is reported at once
OUTAGE_ERRORS = (OperationalError, InterfaceError, DatabaseUnreachableError)


def _outage(exc: BaseException) -> bool:
    return isinstance(exc, OUTAGE_ERRORS) and refusal(exc) is None


def outage_patience() -> float:
    """SPECQ_OUTAGE_PATIENCE_S, or the default; ConfigError naming it when it is not a number >= 0."""
    value = os.environ.get(PATIENCE_ENV)
    if not value:
        return DEFAULT_PATIENCE_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ConfigError(f"{PATIENCE_ENV} must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def _reason(exc: BaseException | None) -> str:
    if exc is None:
        return "no answer"
    return (str(getattr(exc, "orig", None) or exc).strip().splitlines() or [type(exc).__name__])[0]


class Patient:
    """Calls a database read, riding out outages; one instance per command, so it warns once per outage.

    `warn` shows the warning line (the CLI prints it on stderr); `seconds`: the patience (None: from
    SPECQ_OUTAGE_PATIENCE_S)."""

    def __init__(self, warn: Callable[[str], None], seconds: float | None = None) -> None:
        self.warn = warn
        self.seconds = outage_patience() if seconds is None else seconds

    def __call__(self, read: Callable[[], T]) -> T:
        warned = False

        def before_sleep(state: RetryCallState) -> None:
            nonlocal warned
            if not warned:
                error = state.outcome.exception() if state.outcome else None
                self.warn(
                    f"warning: the database is unreachable ({_reason(error)}); "
                    f"trying again for up to {self.seconds:g} s ({PATIENCE_ENV})"
                )
                warned = True

        retrying = Retrying(
            retry=retry_if_exception(_outage),
            stop=stop_after_delay(self.seconds),
            wait=wait_exponential(multiplier=0.5, min=0.5, max=5),
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(read)
        except OUTAGE_ERRORS as exc:
            reason = str(exc) if isinstance(exc, ServiceUnavailableError) else f"lost the database: {_reason(exc)}"
            if warned:
                reason += f"; gave up after {self.seconds:g} s ({PATIENCE_ENV})"
            raise ServiceUnavailableError(reason) from None
