"""What a job's suffix index costs in memory, per context and at its bound.

    python benchmarks/suffix_index_memory.py [--contexts 200000]

Feeds the index (decoding/suffix_index.py) the demo tokenizer's token ids of the held-out standard
library sources until it holds `--contexts` contexts and has evicted, then reports the bytes
tracemalloc sees allocated for it (Python objects: the context tuples, the count dicts, the ordered
dict), per context, and the time one `add` of 1,000 tokens and one `propose` take.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, default=200_000)
    args = parser.parse_args()

    from specq.decoding.suffix_index import SuffixIndex
    from specq.models.demo import build_demo_models, read_source, split_files
    from specq.models.demo.corpus import corpus_files
    from specq.models.loading import load_tokenizer

    tokenizer = load_tokenizer(str(build_demo_models().target_dir))
    _, heldout = split_files(corpus_files())
    tracemalloc.start()
    index = SuffixIndex(max_contexts=args.contexts)
    fed = 0
    add_seconds: list[float] = []
    for path in heldout:
        ids = tokenizer(read_source(path))["input_ids"]
        for start in range(0, len(ids), 1000):
            began = time.perf_counter()
            index.add(ids[start : start + 1000])
            add_seconds.append(time.perf_counter() - began)
            fed += len(ids[start : start + 1000])
        if index.evictions:
            break
    current, _ = tracemalloc.get_traced_memory()
    began = time.perf_counter()
    for start in range(0, 100 * 50, 50):
        index.propose(ids[start : start + 16], limit=8)
    propose_us = (time.perf_counter() - began) / 100 * 1e6
    print(f"fed {fed} tokens; {len(index)} contexts (bound {args.contexts}), {index.evictions} evicted")
    print(f"memory {current / 2**20:.1f} MiB = {current / len(index):.0f} bytes per context")
    print(f"add: {1e3 * sum(add_seconds) / len(add_seconds):.2f} ms per 1,000 tokens; propose: {propose_us:.0f} us")


if __name__ == "__main__":
    main()
