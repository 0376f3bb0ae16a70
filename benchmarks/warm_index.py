"""What a warm suffix index is worth: would sharing it between a job's workers pay?

    python benchmarks/warm_index.py [--requests 128] [--warm 0,32,128,384] [--batch-size 1] [--repeats 2]

A job's suffix index (decoding/suffix_index.py) lives in the worker that decodes: with N workers, each
learns from about 1/N of the job's outputs. Sharing it (through Redis, say) would let each learn from
all of them. What that buys is the difference between an index fed w and one fed N x w earlier
outputs of the same job, so this measures tokens/s against w directly: the templated workload
(bench/workloads.py), `--requests` timed requests, after an index fed the outputs of w OTHER requests
of the same template (as another worker's share of the job would have). Target-only decoding of the
same requests is the reference. Greedy, the demo pair, one process; the rows of each repeat take turns.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--warm", default="0,32,128,384", help="earlier outputs fed to the index, comma-separated")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    warm_sizes = [int(w) for w in args.warm.split(",")]

    from specq.bench.runner import load_bench_pair
    from specq.bench.workloads import workload_prompts
    from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
    from specq.decoding.suffix_index import SuffixIndex
    from specq.models.loading import tokenize_prompt

    pair, *_ = load_bench_pair(None, None, "cpu", None, args.threads, lambda line: None, "off")
    # one template; timed requests and the "other workers'" requests are disjoint
    texts = workload_prompts("templated", args.requests + max(warm_sizes), 256)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    requests = [
        GenerationRequest(i, tuple(tokenize_prompt(pair.tokenizer, prompt=t)), params) for i, t in enumerate(texts)
    ]
    timed, others = requests[: args.requests], requests[args.requests :]

    def engine(model_free, index=None, policy=None):
        config = DecodingConfig(batch_size=args.batch_size, model_free=model_free)
        return SpeculativeEngine(pair.target, pair.tokenizer, None, config, policy=policy, suffix_index=index)

    warmup = engine("suffix", SuffixIndex())
    list(warmup.generate(others[:8]))  # the policy's step times, shared by every suffix run below
    policy = warmup.policy

    def fed_index(warm: int) -> SuffixIndex:
        index = SuffixIndex()
        list(engine("suffix", index, policy).generate(others[:warm]))  # untimed: another worker's share
        return index

    def timed_run(name: str, warm: int) -> tuple[float, float | None]:
        decoder = engine(None) if name == "target_only" else engine("suffix", fed_index(warm), policy)
        started = time.perf_counter()
        tokens = sum(len(r.token_ids) for r in decoder.generate(timed))
        rate = tokens / (time.perf_counter() - started)
        return rate, decoder.stats.acceptance_rate

    runs = [("target_only", 0)] + [("suffix", w) for w in warm_sizes]
    rates: dict[tuple[str, int], list[float]] = {run: [] for run in runs}
    acceptance: dict[tuple[str, int], float | None] = {}
    for _ in range(args.repeats):
        for run in runs:
            rate, accepted = timed_run(*run)
            accepted = None if run[0] == "target_only" else accepted
            rates[run].append(rate)
            acceptance[run] = accepted
    plain = statistics.median(rates[("target_only", 0)])
    print(f"templated, {args.requests} timed requests, batch {args.batch_size}, {args.max_tokens} tokens each")
    print("| index fed with | tokens/s | vs target-only | acceptance |")
    print("| --- | --- | --- | --- |")
    for run in runs:
        name, warm = run
        rate = statistics.median(rates[run])
        label = "target-only" if name == "target_only" else f"{warm} earlier outputs"
        accepted = acceptance[run]
        print(f"| {label} | {rate:.1f} | {rate / plain:.2f}x | {'-' if accepted is None else f'{accepted:.2f}'} |")


if __name__ == "__main__":
    main()
