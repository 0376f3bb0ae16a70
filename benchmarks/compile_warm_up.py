"""What `--compile` costs at load and in a job's first steps, and whether `auto` follows what it measured.

    python benchmarks/compile_warm_up.py [--warm-up] [--requests 32] [--max-tokens 32]

Loads the demo pair with `--compile on` as a worker does (models/loading.py: compile what a job runs
first, check it against eager, measure a decode step both ways where this machine has no measurement
yet), and prints each model's compile seconds, graphs and measured speedup, and how many graphs torch
has compiled so far. Then decodes the held-out continuation prompts through the
engine with the draft model, at batch 1 and at batch 16, twice each, printing each pass's seconds and
the graphs compiled by then: a pass that compiles nothing more adds no graphs. Last, loads the pair
again with `--compile auto` and prints what it chose on this machine.

`--warm-up` also decodes a few ragged requests at load, which compiles every kind of graph a job may
take (as loads did before compiling lazily): the first passes then compile nothing. Compile seconds
depend on inductor's on-disk cache (specq's data directory): run twice to see a second process's.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm-up", action="store_true")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from torch._dynamo.utils import counters

    import specq.models.loading as loading
    from specq.bench.workloads import workload_prompts
    from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
    from specq.models.demo import build_demo_models

    demo = build_demo_models()
    target, draft = str(demo.target_dir), str(demo.draft_dir)
    started = time.perf_counter()
    pair = loading.load_pair(target, draft, "cpu", None, "on", warm_up=args.warm_up)
    print(f"load with --compile on: {time.perf_counter() - started:.1f}s")
    for role, outcome in pair.compiled.items():
        print(f"  {role}: {outcome.summary()}")
    print(f"  warm-up decode: {pair.warm_up_s:.1f}s; graphs compiled so far: {counters['stats']['unique_graphs']}")

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    texts = workload_prompts("continuation", args.requests, 256)
    requests = [
        GenerationRequest(i, tuple(loading.tokenize_prompt(pair.tokenizer, prompt=t)), params)
        for i, t in enumerate(texts)
    ]
    for batch_size in (1, 16, 1, 16):
        engine = SpeculativeEngine(pair.target, pair.tokenizer, pair.draft, DecodingConfig(batch_size=batch_size))
        started = time.perf_counter()
        for _ in engine.generate(requests):
            pass
        seconds = time.perf_counter() - started
        print(
            f"pass at batch {batch_size}: {seconds:.1f}s; graphs compiled so far: {counters['stats']['unique_graphs']}"
        )

    again = loading.load_pair(target, draft, "cpu", None, "auto")
    for role, outcome in again.compiled.items():
        print(f"load with --compile auto, {role}: {outcome.summary()}")


if __name__ == "__main__":
    main()
