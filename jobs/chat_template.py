"""Chat templates: `--chat-template FILE` (a Jinja template, as vLLM's flag takes, read once and at most
specq.limits.CHAT_TEMPLATE_BYTES) and what a job makes of its chat lines (`ChatLines`).

Every chat line is rendered and tokenized at submit (and before `run` generates anything), with the
bounds of `jobs.chat_render`; the job stores the token ids, not the template, so no worker renders. A
line that cannot be rendered is a bad line: the template fails on it or outgrows its bounds, or there
is no template at all (the target's tokenizer has none, and no `--chat-template` was given).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import TracebackType
from typing import TYPE_CHECKING

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.parser import Parser

from specq.errors import ConfigError
from specq.jobs.chat_render import ChatTokens, RenderError
from specq.jobs.inputs import RequestSpec
from specq.limits import CHAT_TEMPLATE_BYTES

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant text for training
    masks); here only parsed, so templates that use it pass the syntax check."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain attribute)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def load_chat_template(path: str) -> str:
    """The template in `path`, once it parses as Jinja (as transformers compiles it); ConfigError
    naming the file and the line otherwise, or when it is larger than CHAT_TEMPLATE_BYTES (read once,
    that far at most: a device that never ends, /dev/zero, is refused too)."""
    try:
        with open(path, "rb") as f:
            data = f.read(CHAT_TEMPLATE_BYTES + 1)
        if len(data) > CHAT_TEMPLATE_BYTES:
            raise ConfigError(f"--chat-template {path}: larger than {CHAT_TEMPLATE_BYTES >> 10} KiB (the limit)")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {path}: cannot read it: {exc}") from None
    environment = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    try:
        environment.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template {path}: line {exc.lineno}: {exc.message}") from None
    return text


def no_template_refusal(target: str) -> str:
    return (
        f"chat messages need a chat template, and the tokenizer of {target!r} has none: "
        "give one with --chat-template FILE, or send a plain prompt"
    )


class ChatLines:
    """What a job makes of a line (`jobs.inputs.Preparation`): a chat line becomes the same spec with
    its prompt token ids, rendered with `template` (None: the target tokenizer's own), or the reason it
    cannot; other lines pass as they are. The tokenizer is loaded at the first chat line. A context
    manager: it stops the renderer."""

    def __init__(self, target: str, template: str | None, load: Callable[[str], PreTrainedTokenizerBase]) -> None:
        self.target, self.template, self.load = target, template, load
        self._tokens: ChatTokens | None = None
        self._missing = False

    def __call__(self, spec: RequestSpec) -> RequestSpec | str:
        if spec.kind != "chat" or spec.messages is None:
            return spec
        tokens = self._chat_tokens()
        if tokens is None:
            return no_template_refusal(self.target)
        try:
            ids = tokens.token_ids(spec.messages)
        except RenderError as exc:
            return str(exc)
        return replace(spec, prompt_token_ids=tuple(ids))

    def _chat_tokens(self) -> ChatTokens | None:
        if self._tokens is None and not self._missing:
            from specq.models.loading import has_chat_template

            tokenizer = self.load(self.target)
            if self.template is None and not has_chat_template(tokenizer):
                self._missing = True
                return None
            self._tokens = ChatTokens(tokenizer, self.template)
        return self._tokens

    def close(self) -> None:
        if self._tokens is not None:
            self._tokens.close()

    def __enter__(self) -> ChatLines:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
