"""Chat prompts of two open-answer kinds for `specq draft train` measurements, from text every machine has
(the docstrings of the Python standard library's modules, their functions, classes and methods):

    python benchmarks/distill_prompts.py [--count 200] [--seed 0] > prompts.jsonl

- qa: "what is X for?" (a module, function, class or method), answered in a sentence or two;
- summarize: a docstring's first paragraph (120 to 800 characters), to summarize in one sentence.

Neither answer is in its prompt, so prompt lookup and the suffix index have little to copy: what is
accepted is what the draft learned of the target. Lines are OpenAI Batch chat lines. The first ones
(as many as the modules, functions and classes with a docstring: 293 on Python 3.11) alternate kinds over
those docstrings, shuffled with the seed, as this script has always made them; then each of them in the
kind it did not take, and the methods' docstrings in both kinds, shuffled: about 1,240 distinct prompts
before any repeats.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys


def docstrings(methods: bool = False) -> list[tuple[str, str]]:
    """(dotted name, first docstring paragraph) of the stdlib's public modules and their top-level
    functions and classes, or with `methods` of their classes' public methods, sorted by name."""
    from specq.models.demo.corpus import corpus_files, read_source, stdlib_root

    root = stdlib_root()
    found = []
    for path in corpus_files():
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not parts or any(part.startswith("_") or part in ("test", "tests", "idlelib") for part in parts):
            continue
        try:
            tree = ast.parse(read_source(path))
        except (SyntaxError, ValueError):
            continue
        module = ".".join(parts)
        public = [node for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)]
        public = [node for node in public if not node.name.startswith("_")]
        named: list[tuple[str, ast.Module | ast.FunctionDef | ast.ClassDef]]
        if methods:
            named = [
                (f"{module}.{node.name}.{method.name}", method)
                for node in public
                if isinstance(node, ast.ClassDef)
                for method in node.body
                if isinstance(method, ast.FunctionDef) and not method.name.startswith("_")
            ]
        else:
            named = [(module, tree)] + [(f"{module}.{node.name}", node) for node in public]
        for name, node in named:
            paragraph = " ".join((ast.get_docstring(node) or "").strip().split("\n\n")[0].split())
            if 120 <= len(paragraph) <= 800:
                found.append((name, paragraph))
    return sorted(found)


def prompt_lines(count: int, seed: int) -> list[dict]:
    modules = docstrings()
    rng = random.Random(seed)
    rng.shuffle(modules)
    first = [(doc, "qa" if i % 2 == 0 else "summarize") for i, doc in enumerate(modules)]
    rest = [(doc, "summarize" if kind == "qa" else "qa") for doc, kind in first]
    rest += [(doc, kind) for doc in docstrings(methods=True) for kind in ("qa", "summarize")]
    rng.shuffle(rest)
    prompts = first + rest
    lines = []
    for i in range(count):
        (name, paragraph), kind = prompts[i % len(prompts)]
        if kind == "qa":
            text = f"What is `{name}` in the Python standard library for? Answer in one or two sentences."
        else:
            text = f"Summarize this in one sentence:\n\n{paragraph}"
        lines.append(
            {
                "custom_id": f"{kind}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "target", "messages": [{"role": "user", "content": text}]},
            }
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for line in prompt_lines(args.count, args.seed):
        sys.stdout.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
