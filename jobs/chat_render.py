"""Chat lines rendered where their cost falls on the one who sent them, with a bound on each rendering.

A chat template is code its user wrote (`--chat-template`), or that came with a model: a loop of 10^10
steps, or a string of gigabytes, is two lines of Jinja. So `submit` renders every chat line and stores
its token ids (as OpenAI and vLLM tokenize before scheduling), and a worker runs no template: it
decodes the stored ids. `run` renders the same way before it generates.

Each rendering runs in a child process (`jobs.chat_sandbox`): Jinja's sandbox as transformers renders,
an address space of specq.limits.CHAT_RENDER_MEMORY_BYTES, an output of RENDERED_PROMPT_CHARS at most,
and a wall-clock bound per line (SPECQ_CHAT_TEMPLATE_SECONDS, default 10 s), past which the child is
killed (a fresh one renders the next line; after GIVE_UP_AFTER_TIMEOUTS such lines, none is tried
again). A line whose rendering fails, outlasts its time or outgrows its bounds is a bad line, reported
with its number like any other.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import time
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from specq.errors import ConfigError, printable
from specq.limits import (
    CHAT_RENDER_MEMORY_BYTES,
    CHAT_TEMPLATE_SECONDS,
    DEFAULT_CHAT_TEMPLATE_SECONDS,
    RENDERED_PROMPT_CHARS,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SECONDS_ENV = "SPECQ_CHAT_TEMPLATE_SECONDS"
# the renderer needs no math library's thread pool (numpy comes with transformers' utilities)
ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
# after this many lines outlast their time, the template is not run again: a file of 100,000 such lines
# would otherwise hold its submit for days
GIVE_UP_AFTER_TIMEOUTS = 3
STARTUP_SECONDS = 120.0  # for the child to import its libraries: not a line's time, and slow on a busy machine


class RenderError(Exception):
    """One line's rendering failed; the message says why (for `INPUT:LINE: ...` or a request's error)."""


def render_seconds_from_env() -> float:
    text = os.environ.get(SECONDS_ENV, "").strip()
    if not text:
        return DEFAULT_CHAT_TEMPLATE_SECONDS
    try:
        seconds = float(text)
        CHAT_TEMPLATE_SECONDS.check(SECONDS_ENV, seconds)
    except ValueError as exc:
        raise ConfigError(f"{SECONDS_ENV}: {exc}") from None
    return seconds


class ChatRenderer:
    """Renders chat messages with one template in a sandboxed child process (started at the first line,
    again after one was killed); a context manager that stops it."""

    def __init__(
        self,
        template: str,
        variables: dict[str, Any],
        seconds: float | None = None,
        max_chars: int = RENDERED_PROMPT_CHARS,
        memory_bytes: int = CHAT_RENDER_MEMORY_BYTES,
    ) -> None:
        self.settings = {"template": template, "variables": variables, "max_chars": max_chars}
        self.settings["memory_bytes"] = memory_bytes
        self.seconds = render_seconds_from_env() if seconds is None else seconds
        self._child: subprocess.Popen[bytes] | None = None
        self.timeouts = 0

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text of `messages` with an open assistant turn; RenderError if the template fails,
        takes longer than its time, or outgrows its memory or output bound."""
        if self.timeouts >= GIVE_UP_AFTER_TIMEOUTS:
            raise RenderError(
                f"not rendered: the chat template took longer than {self.seconds:g}s (the limit) on "
                f"{self.timeouts} lines already"
            )
        child = self._started()
        assert child.stdin is not None and child.stdout is not None
        try:
            child.stdin.write(json.dumps({"messages": messages}, ensure_ascii=False).encode() + b"\n")
            child.stdin.flush()
        except OSError:
            self._stop()
            raise RenderError("the chat template's renderer stopped before the line reached it") from None
        answer = _read_line(child.stdout, time.monotonic() + self.seconds)
        if answer is None:  # out of time (the child is killed: its loop may never end) or dead
            code = self._stop()
            if code is not None and code != -9:
                raise RenderError(f"the chat template's renderer stopped (exit code {code}): out of memory?")
            self.timeouts += 1
            raise RenderError(f"rendering the chat template took longer than {self.seconds:g}s (the limit)")
        reply = json.loads(answer)
        if "error" in reply:  # the template's own text (raise_exception): escaped, it forges no line
            raise RenderError(printable(str(reply["error"])))
        return str(reply["text"])

    def _started(self) -> subprocess.Popen[bytes]:
        if self._child is None:
            # -P: a folder the user runs specq from never shadows a module; stderr: the template's
            # library warnings are not the user's concern
            self._child = subprocess.Popen(
                [sys.executable, "-P", "-m", "specq.jobs.chat_sandbox"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={**os.environ, **ONE_THREAD},
            )
            assert self._child.stdin is not None and self._child.stdout is not None
            with contextlib.suppress(OSError):  # it died: no ready line comes
                self._child.stdin.write(json.dumps(self.settings).encode() + b"\n")
                self._child.stdin.flush()
            if _read_line(self._child.stdout, time.monotonic() + STARTUP_SECONDS) is None:
                self._stop()
                raise RenderError("the chat template's renderer did not start")
        return self._child

    def _stop(self) -> int | None:
        """Stop the child (it may be looping); its exit code if it had already exited by itself."""
        child, self._child = self._child, None
        if child is None:
            return None
        code = child.poll()
        if code is None:
            child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        return code

    def close(self) -> None:
        self._stop()

    def __enter__(self) -> ChatRenderer:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def _read_line(stream: IO[bytes], deadline: float) -> bytes | None:
    """One line from the child, or None if it did not come by `deadline` or the child closed its end."""
    pieces: list[bytes] = []
    fd = stream.fileno()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                return None
            piece = os.read(fd, 1 << 20)
            if not piece:
                return None
            pieces.append(piece)
            if piece.endswith(b"\n"):
                return b"".join(pieces)


class ChatTokens:
    """Token ids of chat messages, as `tokenizer.apply_chat_template(..., add_generation_prompt=True)`
    gives them, but rendered by a ChatRenderer: `template` (None: the tokenizer's own)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: str | None, seconds: float | None = None) -> None:
        self.tokenizer = tokenizer
        # ValueError when neither is there (callers check has_chat_template first)
        text = tokenizer.get_chat_template(template)
        self.renderer = ChatRenderer(text, dict(tokenizer.special_tokens_map), seconds)

    def token_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.renderer.render(messages)
        # as apply_chat_template: the template writes the special tokens itself
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def close(self) -> None:
        self.renderer.close()
