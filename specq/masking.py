"""Secrets never reach a log line, an error message, a traceback or `ps`: every credential shows as ***.

A URL carries credentials in several forms, all accepted by libpq, SQLAlchemy or redis-py:

- userinfo: `postgresql://user:SECRET@host/db`, `redis://:SECRET@host/0`;
- query parameters: `?password=SECRET`, `?sslpassword=SECRET`, and tokens or keys (`token=`,
  `access_token=`, `api_key=`, `secret=` ...);
- the same `name=value` pairs in a libpq connection string (`host=h password=SECRET`).

`mask_text` rewrites all of them in any text by their shape (no URL needs to be known), and also
replaces the credentials of the URLs this process was given (`register_urls`) wherever they appear
alone, e.g. in a library's message. It is applied to every log line (each handler of the root logger
formats, then masks; tracebacks included), to uncaught exceptions (`sys.excepthook`), to the CLI's error
messages, and to this process's title when its command line holds a credential (`mask_process_title`),
so `ps` shows it masked. Workers started by `specq autoscale` get the URLs in their environment, never
on their command line. Celery's own masked form (`redis://user:**@host`) is rewritten to `***` too, so
one pattern finds a credential in any log.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from types import TracebackType
from urllib.parse import parse_qsl, unquote, urlsplit

MASK = "***"
# the names of query or connection-string parameters that hold a secret
_SECRET_NAME = r"[\w.-]*(?:password|passwd|pwd|secret|token|api[_-]?key|access[_-]?key|auth)"
_SECRET_PARAM = re.compile(rf"(?i)(?<![\w.-])({_SECRET_NAME}=)(?!\*\*\*)[^&\s'\",;)]+")
_SECRET_NAME_ONLY = re.compile(rf"(?i)^{_SECRET_NAME}$")
# scheme://user:password@ (also Celery's `user:**@`), the password up to the last @ before the host.
# Linear on any text: a scheme is tried only where a run of scheme characters begins (the lookbehind),
# so a long run is scanned once, not from each of its characters (that was quadratic: 18 s for 40 KB)
_USERINFO = re.compile(r"(?<![\w+.-])([\w+.-]+://[^:/@\s]*):[^\s/]*@(?=[^@\s]*(?:[/?#\s]|$))")
_secrets: set[str] = set()
_lock = threading.Lock()


def password_of(url: str | None) -> str | None:
    """The password in a URL's userinfo (as written), or None."""
    if not url:
        return None
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return password or None


def credentials_of(url: str | None) -> set[str]:
    """Every secret a URL carries: its userinfo password and its secret query parameters, each as
    written and percent-decoded."""
    if not url:
        return set()
    found = set()
    password = password_of(url)
    if password and password.strip("*"):  # not an already masked one
        found.add(password)
    try:
        query = urlsplit(url).query
    except ValueError:
        query = ""
    found.update(value for name, value in parse_qsl(query) if value and _SECRET_NAME_ONLY.match(name))
    return {form for secret in found for form in (secret, unquote(secret))}


def register_urls(*urls: str | None) -> None:
    """Mask the credentials of these URLs in every log line from now on; wraps the root handlers."""
    with _lock:
        for url in urls:
            _secrets.update(credentials_of(url))
    install()


def mask_text(text: str) -> str:
    """`text` with every credential replaced by ***: the registered ones, and any by its shape."""
    for secret in sorted(_secrets, key=len, reverse=True):
        text = text.replace(secret, MASK)
    text = _USERINFO.sub(rf"\1:{MASK}@", text)
    return _SECRET_PARAM.sub(rf"\1{MASK}", text)


def mask_url(url: str) -> str:
    """A service URL (database, broker) with every credential replaced by ***, for messages and logs."""
    return mask_text(url)


class MaskingFormatter(logging.Formatter):
    """Formats with the handler's own formatter, then masks."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return mask_text(self.inner.format(record))


def _masked_excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    import traceback

    sys.stderr.write(mask_text("".join(traceback.format_exception(kind, value, tb))))


def install() -> None:
    """Wrap the formatter of every root handler (once each; handlers added later need another call), and
    mask the traceback of an uncaught exception."""
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, MaskingFormatter):
            handler.setFormatter(MaskingFormatter(handler.formatter))
    sys.excepthook = _masked_excepthook


def mask_process_title(argv: list[str]) -> None:
    """When the command line holds a credential (`--database-url postgresql://u:SECRET@...`), show it
    masked to `ps` and /proc/PID/cmdline, which every user of the machine can read. `argv` (sys.argv,
    once parsed) is masked in place too: Celery builds its own process title from it."""
    masked = [mask_text(arg) for arg in argv]
    if masked != argv:
        import setproctitle

        argv[:] = masked
        setproctitle.setproctitle(" ".join(masked))
