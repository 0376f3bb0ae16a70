"""Chat templates: `--chat-template FILE` (a Jinja template, as vLLM's flag takes) and the refusal of
chat lines that nothing could render.

The template's text is stored with the job, so workers on other machines render with it. A line of
chat messages on a target whose tokenizer has no chat template, with no `--chat-template`, is refused
at submit (and before `run` generates anything), like a bad line: no worker could render it.
"""

from __future__ import annotations

from collections.abc import Callable

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.parser import Parser

from specq.errors import ConfigError
from specq.jobs.inputs import Refusal, RequestSpec


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant text for training
    masks); here only parsed, so templates that use it pass the syntax check."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain attribute)

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def load_chat_template(path: str) -> str:
    """The template in `path`, once it parses as Jinja (as transformers compiles it); ConfigError
    naming the file and the line otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {path}: cannot read it: {exc}") from None
    environment = jinja2.Environment(extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    try:
        environment.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template {path}: line {exc.lineno}: {exc.message}") from None
    return text


def refuse_chat_without_template(target: str, template_missing: Callable[[], bool]) -> Refusal:
    """The refusal of chat lines when `template_missing()` (asked at the first chat line only)."""

    def refuse(spec: RequestSpec) -> str | None:
        if spec.kind != "chat" or not template_missing():
            return None
        return (
            f"chat messages need a chat template, and the tokenizer of {target!r} has none: "
            "give one with --chat-template FILE, or send a plain prompt"
        )

    return refuse
