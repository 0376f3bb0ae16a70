"""What reproducible sampling costs: acceptance and throughput of `--sampling exact` against
`--sampling reproducible` on the demo pair, K fixed, at each temperature.

    python benchmarks/sampling_modes.py [--prompts 32] [--batch-size 8] [--repeats 3]

Same held-out prompts as `specq bench` (request i has seed i). Every run gets one untimed warm-up
pass, then the timed passes go round-robin over the runs; tokens/s is the median pass. Acceptance
is vLLM's rate (accepted / draft tokens) and the mean acceptance length (tokens a row gains per
step). "same as target-only" checks the reproducible guarantee on real models: the speculative
run's tokens against target-only decoding's in reproducible mode, request for request.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--temperatures", default="1.0,0.7")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    from specq.bench.runner import prompt_token_ids
    from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
    from specq.decoding.config import SamplingMode
    from specq.models.demo import build_demo_models
    from specq.models.loading import load_pair

    demo = build_demo_models()
    pair = load_pair(str(demo.target_dir), str(demo.draft_dir), "cpu", None)
    _, prompts = prompt_token_ids(pair.tokenizer, args.prompts, 256)

    print("| temperature | sampling | a (acc/draft) | mean acc. len | spec K tok/s | target-only tok/s ", end="")
    print("| same as target-only |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for temperature in (float(t) for t in args.temperatures.split(",")):
        params = [
            SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i) for i in range(len(prompts))
        ]
        requests = [GenerationRequest(i, tuple(p), params[i]) for i, p in enumerate(prompts)]
        engines = {}
        modes: tuple[SamplingMode, ...] = ("exact", "reproducible")
        for mode in modes:
            config = DecodingConfig(
                num_speculative_tokens=args.num_speculative_tokens,
                fixed_k=True,
                batch_size=args.batch_size,
                sampling=mode,
            )
            engines[(mode, "spec")] = SpeculativeEngine(pair.target, pair.tokenizer, pair.draft, config)
            engines[(mode, "target")] = SpeculativeEngine(pair.target, pair.tokenizer, None, config)
        outputs: dict[tuple[str, str], dict[int, list[int]]] = {}
        rates: dict[tuple[str, str], list[float]] = {name: [] for name in engines}
        for name, engine in engines.items():  # warm-up
            outputs[name] = {r.key: r.token_ids for r in engine.generate(requests)}
            engine.reset_stats()
        for _ in range(args.repeats):
            for name, engine in engines.items():
                began = time.perf_counter()
                tokens = sum(len(r.token_ids) for r in engine.generate(requests))
                rates[name].append(tokens / (time.perf_counter() - began))
        for mode in modes:
            stats = engines[(mode, "spec")].stats
            same = sum(outputs[(mode, "spec")][i] == outputs[(mode, "target")][i] for i in range(len(prompts)))
            print(
                f"| {temperature} | {mode} | {stats.acceptance_rate:.3f} | {stats.mean_acceptance_length:.2f} | "
                f"{statistics.median(rates[(mode, 'spec')]):.1f} | {statistics.median(rates[(mode, 'target')]):.1f} | "
                f"{same}/{len(prompts)} |"
            )


if __name__ == "__main__":
    main()
