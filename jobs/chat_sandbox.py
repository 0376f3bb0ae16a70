"""The child process that renders chat templates (`jobs.chat_render` starts it): user-controlled Jinja
runs here, never in a submit's or a worker's own process.

Jinja's sandbox (transformers renders in its ImmutableSandboxedEnvironment) keeps a template from
reaching Python's internals, but not from looping for ever or building a string of gigabytes. So this
process caps its own address space (RLIMIT_AS: a budget over what its imports mapped) before it reads
a template, refuses an output past
`max_chars`, and its parent kills it when one rendering outlasts its time. It imports transformers'
chat-template utilities only (no torch), so its baseline stays far below the cap.

Protocol, one JSON object a line: the parent sends the settings first, `{"template", "variables",
"max_chars", "memory_bytes"}` (`variables`: the tokenizer's special tokens, as `apply_chat_template`
passes them), then one `{"messages": [...]}` a rendering; this process says `{"ready": true}` once
started, then answers each rendering with `{"text": ...}` or `{"error": ...}`.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any

MAX_ERROR_CHARS = 500  # of a template's own error message, which the template may make huge


def _render(template: str, variables: dict[str, Any], messages: list[dict[str, Any]], max_chars: int) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    # as apply_chat_template: keys whose value is None dropped, an open assistant turn
    chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
    rendered, _ = render_jinja_template(
        conversations=[chat], chat_template=template, add_generation_prompt=True, **variables
    )
    text = rendered[0]
    if len(text) > max_chars:
        raise ValueError(f"the rendered prompt has {len(text)} characters, over the limit of {max_chars}")
    return text


def _mapped() -> int:
    """This process's address space now, in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0


def _answer(out: Any, **payload: Any) -> None:
    out.write(json.dumps(payload, ensure_ascii=False) + "\n")
    out.flush()


def main() -> None:
    import transformers.utils.chat_template_utils  # noqa: F401 (imported under no cap: only rendering is capped)

    settings = json.loads(sys.stdin.readline())
    limit = int(settings["memory_bytes"])
    # the budget on top of what the imports mapped (thread stacks and arenas grow with the cores)
    resource.setrlimit(resource.RLIMIT_AS, (_mapped() + limit,) * 2)
    _answer(sys.stdout, ready=True)  # started: from here on, the parent times each line
    template, variables, max_chars = settings["template"], settings["variables"], int(settings["max_chars"])
    for line in sys.stdin:
        try:
            text = _render(template, variables, json.loads(line)["messages"], max_chars)
        except MemoryError:
            _answer(sys.stdout, error=f"the chat template needs more than {limit >> 20} MiB of memory")
            continue
        except Exception as exc:  # the template's own error (raise_exception, a bad variable ...)
            reason = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            _answer(sys.stdout, error=f"the chat template fails: {reason}")
            continue
        _answer(sys.stdout, text=text)


if __name__ == "__main__":
    main()
