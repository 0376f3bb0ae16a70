"""The held-out workloads of the draft-axis benchmark, built from text every machine has: the Python
standard library's own sources (models/demo/corpus.py, the held-out files the demo models never saw)
and its module names (`sys.stdlib_module_names`).

- continuation: the start of a held-out function; the model continues it (today's bench prompts).
- grounded: a held-out function's first `prompt_chars` characters, then the first line of the same
  function under a new name: the answer reproduces the body with that one change (a code edit).
- templated: one template, a Python list of records about standard-library modules, three filled in
  and the last one opened for module i (the dotted names of the stdlib's own source files: about 600
  distinct, so a job of hundreds of requests repeats no prompt); answers share their structure with
  each other.
"""

from __future__ import annotations

import re
from typing import Any

from specq.limits import BENCH_WORKLOADS as WORKLOADS

_TEMPLATE_HEAD = (
    "# Standard library modules: name, kind, and what each one is for.\n"
    "MODULES = [\n"
    '    {"name": "json", "kind": "module", "purpose": "encode and decode JSON documents"},\n'
    '    {"name": "os", "kind": "module", "purpose": "use operating system services"},\n'
    '    {"name": "re", "kind": "module", "purpose": "match text with regular expressions"},\n'
)
_DEF_NAME = re.compile(r"def\s+(\w+)")


def workload_prompts(name: str, count: int, prompt_chars: int) -> list[str]:
    """`count` prompts of workload `name` (one of WORKLOADS), deterministic."""
    from specq.models.demo import heldout_prompts

    if name == "continuation":
        return heldout_prompts(count, prompt_chars)
    if name == "grounded":
        return [_edit_prompt(text) for text in heldout_prompts(count, prompt_chars)]
    if name == "templated":
        modules = _module_names()
        if count > len(modules):
            raise ValueError(f"the templated workload has {len(modules)} distinct prompts; asked for {count}")
        step = len(modules) // count
        return [
            _TEMPLATE_HEAD + f'    {{"name": "{modules[(i * step) % len(modules)]}", "kind": "' for i in range(count)
        ]
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")


def greedy_requests(tokenizer: Any, name: str, count: int, max_tokens: int, prompt_chars: int = 256) -> list[Any]:
    """`count` greedy `GenerationRequest`s of workload `name`, keyed 0..count-1, tokenized as the draft
    axis tokenizes its prompts (the benchmark scripts' jobs)."""
    from specq.decoding import GenerationRequest, SamplingParams
    from specq.models.loading import tokenize_prompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    texts = workload_prompts(name, count, prompt_chars)
    return [
        GenerationRequest(i, tuple(tokenize_prompt(tokenizer, prompt=text)), params) for i, text in enumerate(texts)
    ]


def _module_names() -> list[str]:
    """The dotted module names of the stdlib's source files (json.decoder, email.mime.text, ...)."""
    from specq.models.demo.corpus import corpus_files, stdlib_root

    root = stdlib_root()
    names = set()
    for path in corpus_files():
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts and not any(part.startswith("_") for part in parts):
            names.add(".".join(parts))
    return sorted(names)


def _edit_prompt(function: str) -> str:
    first_line = function.splitlines()[0]
    match = _DEF_NAME.search(first_line)
    renamed = first_line.replace(match.group(1), match.group(1) + "_v2", 1) if match else first_line
    return f"{function}\n\n\n# The same function under a new name:\n{renamed}\n"
