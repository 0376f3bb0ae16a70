"""A compiled decode step against eager as the KV cache's capacity grows: one target step of `--rows`
rows, one token each, over a 264-column window of a cache of each `--capacities` columns.

    python benchmarks/compiled_step_capacity.py [--rows 16] [--capacities 400,3200] [--rounds 2]

The demo target, fp32, `torch.compile(dynamic=False)` (inductor). A step's time should not depend on
the capacity (attention reads the same columns): where the compiled one grows with it, the compiled
graph copies the cache's buffers instead of writing them in place. Medians of 10 steps after 2, for
each capacity, eager then compiled, `--rounds` times.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--capacities", default="400,3200")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import torch

    from specq.decoding.hf_model import LAST_ONLY, RaggedLM
    from specq.models.demo import build_demo_models
    from specq.models.loading import load_pair

    demo = build_demo_models()
    model = load_pair(str(demo.target_dir), str(demo.draft_dir), "cpu", None).target
    compiled = torch.compile(model, dynamic=False)
    rows, prompt, window = args.rows, 256, 264

    def step_ms(candidate, capacity: int, steps: int = 12) -> float:
        lm = RaggedLM(candidate)
        cache = lm.new_cache(rows, capacity)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, lm.vocab_size, (rows, prompt), generator=generator)
        times = []
        with torch.inference_mode():
            lm.prefill(cache, torch.arange(rows), ids, lm.vocab_size, keep=LAST_ONLY)
            for _ in range(steps):
                columns = torch.randint(prompt - 6, prompt, (rows, 1), generator=generator)
                started = time.perf_counter()
                lm.step(cache, ids[:, :1], columns, window, lm.vocab_size)
                times.append(time.perf_counter() - started)
        return statistics.median(times[2:]) * 1e3

    capacities = [int(c) for c in args.capacities.split(",")]
    started = time.perf_counter()
    for capacity in capacities:
        step_ms(compiled, capacity, steps=3)
    print(f"compiled in {time.perf_counter() - started:.0f}s; {rows} rows, 1 token each, ms a step")
    print("| round | capacity | eager ms | compiled ms |")
    print("| --- | --- | --- | --- |")
    for round_ in range(1, args.rounds + 1):
        for capacity in capacities:
            eager, fast = step_ms(model, capacity), step_ms(compiled, capacity)
            print(f"| {round_} | {capacity} | {eager:.2f} | {fast:.2f} |", flush=True)


if __name__ == "__main__":
    main()
