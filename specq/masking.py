"""Secrets never reach a log line: every handler of the root logger masks them as ***.

The passwords of the service URLs this process uses are registered (`register_urls`); each formatted
log line, traceback included, has them replaced by ***. Celery and kombu write their own masked form
of a URL (`redis://user:**@host`); that is rewritten to specq's `***` too, so one pattern finds a
credential in any log. Messages that specq itself builds mask URLs with `db.session.mask_url`.
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import unquote, urlsplit

MASK = "***"
_CELERY_MASK = re.compile(r"(://[^:/@\s]*):\*\*@")  # kombu's maybe_sanitize_url(mask="**")
_secrets: set[str] = set()
_lock = threading.Lock()


def password_of(url: str | None) -> str | None:
    """The password in a URL (as written, and percent-decoded), or None."""
    if not url:
        return None
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return password or None


def register_urls(*urls: str | None) -> None:
    """Mask the passwords of these URLs in every log line from now on; wraps the root handlers."""
    with _lock:
        for url in urls:
            password = password_of(url)
            if password:
                _secrets.update({password, unquote(password)})
    install()


def mask_text(text: str) -> str:
    for secret in sorted(_secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    return _CELERY_MASK.sub(rf"\1:{MASK}@", text)


class MaskingFormatter(logging.Formatter):
    """Formats with the handler's own formatter, then masks."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return mask_text(self.inner.format(record))


def install() -> None:
    """Wrap the formatter of every root handler (once each); handlers added later need another call."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, MaskingFormatter):
            handler.setFormatter(MaskingFormatter(handler.formatter))
