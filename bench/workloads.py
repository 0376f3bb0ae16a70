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

Chat workloads, the work real batch users send an instruct model (one user turn each, rendered with the
target tokenizer's chat template):

- code-edit: rewrite or annotate a given standard-library function (type hints, a docstring, a rename);
- extract: pull sentences or names out of a given passage (a standard-library docstring);
- summarize: summarize a given passage (a module's docstring);
- qa: an open question about a standard-library module, with no context to copy from.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from typing import Any

from specq.limits import BENCH_CHAT_WORKLOADS as CHAT_WORKLOADS
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
    """`count` prompts of workload `name` (one of WORKLOADS), deterministic: for a chat workload, the
    user turns (`prompt_chars` applies to the others)."""
    from specq.models.demo import heldout_prompts

    if name in CHAT_WORKLOADS:
        return _chat_turns(name, count)
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


def workload_token_ids(tokenizer: Any, name: str, count: int, prompt_chars: int) -> list[list[int]]:
    """The prompts of workload `name` as `tokenizer`'s token ids: a chat workload's turns rendered with its
    chat template and an open assistant turn, as `specq run` renders chat lines."""
    from specq.models.loading import tokenize_prompt

    texts = workload_prompts(name, count, prompt_chars)
    if name in CHAT_WORKLOADS:
        return [tokenize_prompt(tokenizer, messages=[{"role": "user", "content": text}]) for text in texts]
    return [tokenize_prompt(tokenizer, prompt=text) for text in texts]


def greedy_requests(tokenizer: Any, name: str, count: int, max_tokens: int, prompt_chars: int = 256) -> list[Any]:
    """`count` greedy `GenerationRequest`s of workload `name`, keyed 0..count-1, tokenized as the draft
    axis tokenizes its prompts (the benchmark scripts' jobs)."""
    from specq.decoding import GenerationRequest, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    prompts = workload_token_ids(tokenizer, name, count, prompt_chars)
    return [GenerationRequest(i, tuple(ids), params) for i, ids in enumerate(prompts)]


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


# -- chat workloads -------------------------------------------------------------------------------------
_CODE_EDITS = (
    "Add type hints to this function. Reply with the whole function.",
    "Add a docstring to this function. Reply with the whole function.",
    "Rename this function to `{name}_v2` and its local variables to clearer names. Reply with the code.",
)
_EXTRACTS = (
    "Copy the first two sentences of this passage, word for word.",
    "List the Python names (functions, classes, modules, arguments) this passage mentions, one per line.",
)
_FUNCTION_CHARS = (200, 700)  # short enough for a small model's context, long enough to copy from
_PASSAGE_CHARS = (300, 1200)


def _chat_turns(name: str, count: int) -> list[str]:
    if name == "code-edit":
        functions = _spread(_stdlib_functions(), count, name)
        return [
            f"{_CODE_EDITS[i % len(_CODE_EDITS)].format(name=function_name)}\n\n```python\n{source}\n```"
            for i, (function_name, source) in enumerate(functions)
        ]
    if name == "extract":
        passages = _spread(_stdlib_docstrings(), count, name)
        return [f"{_EXTRACTS[i % len(_EXTRACTS)]}\n\n{text}" for i, (_, text) in enumerate(passages)]
    if name == "summarize":
        passages = _spread([d for d in _stdlib_docstrings() if d[0].count(".") == 0], count, name)
        return [
            f"Summarize this documentation of Python's `{module}` in two sentences.\n\n{text}"
            for module, text in passages
        ]
    if name == "qa":
        modules = _spread([m for m in _module_names() if "." not in m], count, name)
        return [f"What is Python's `{module}` module for? Answer in two or three sentences." for module in modules]
    raise ValueError(f"unknown chat workload {name!r}; choose from {', '.join(CHAT_WORKLOADS)}")


def _spread(items: list, count: int, name: str) -> list:
    """`count` of `items`, spread evenly over them (so over the library, not its first package)."""
    if count > len(items):
        raise ValueError(f"the {name} workload has {len(items)} distinct prompts; asked for {count}")
    step = len(items) // count
    return [items[i * step] for i in range(count)]


@lru_cache(maxsize=1)
def _stdlib_functions() -> list[tuple[str, str]]:
    """(name, source) of the stdlib's top-level functions of a readable size, with no docstring (one to
    add); in file order."""
    found = []
    for _, tree, text in _parsed_sources():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node) is None:
                source = ast.get_source_segment(text, node) or ""
                if _FUNCTION_CHARS[0] <= len(source) <= _FUNCTION_CHARS[1]:
                    found.append((node.name, source))
    return found


@lru_cache(maxsize=1)
def _stdlib_docstrings() -> list[tuple[str, str]]:
    """(module, docstring) of the stdlib's modules whose docstring is a passage of a readable size."""
    found = []
    for module, tree, _ in _parsed_sources():
        text = (ast.get_docstring(tree) or "").strip()
        if _PASSAGE_CHARS[0] <= len(text) <= _PASSAGE_CHARS[1]:
            found.append((module, text))
    return found


@lru_cache(maxsize=1)
def _parsed_sources() -> list[tuple[str, ast.Module, str]]:
    """(dotted module name, syntax tree, source) of the stdlib's public modules, in file order."""
    from specq.models.demo.corpus import corpus_files, read_source, stdlib_root

    root = stdlib_root()
    parsed = []
    for path in corpus_files():
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not parts or any(part.startswith("_") for part in parts):
            continue
        text = read_source(path)
        try:
            parsed.append((".".join(parts), ast.parse(text), text))
        except SyntaxError:  # a file for another Python (lib2to3's fixtures): not a prompt
            continue
    return parsed
