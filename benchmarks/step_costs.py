"""Where each draft-axis contender's time goes: prefill, plain steps, speculative steps by width.

    python benchmarks/step_costs.py [--workload continuation] [--batch-size 16] [--requests 64]
        [--max-tokens 32] [--contenders target_only,ngram,suffix,hybrid,draft] [--probe-interval 16]
        [--target T --draft D] [-k K] [--fixed-k] [--threads N]

The same engines as `specq bench --workloads` (bench/draft_axis.py: the demo pair unless `--target`,
greedy, each contender at its default K unless `-k`), one warm-up pass, then one timed pass sharing
the warm-up's policy. For each
contender: tokens/s, the whole pass and its prefill in seconds, the prompt tokens it prefilled (the rest
were a head another row held: decoding/prefix_reuse.py), the steps taken, and at the full batch
the mean seconds of a plain step and of its target forward, the policy's median of the proposer's
offers (prompt lookups, suffix-index walks, the hybrid weighing its plans) over its last steps, and the
target forward at each width verified (tokens a row). `--probe-interval` sets the adaptive policy's
probing (a large value: none).
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="continuation")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--contenders", default="target_only,ngram,suffix,hybrid,draft")
    parser.add_argument("--probe-interval", type=int, default=16)
    parser.add_argument("--target", default=None, help="[default: the demo pair]")
    parser.add_argument("--draft", default=None, help="a draft model or a draft head's folder")
    parser.add_argument("-k", type=int, default=None, help="K [default: each contender's own]")
    parser.add_argument("--fixed-k", action="store_true", help="every step proposes K")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from specq.bench.draft_axis import DRAFTS
    from specq.bench.runner import load_bench_pair
    from specq.bench.workloads import greedy_requests
    from specq.decoding import DecodingConfig, SpeculativeEngine

    pair, *_ = load_bench_pair(args.target, args.draft, "cpu", None, args.threads, lambda line: None, "off")
    requests = greedy_requests(pair.tokenizer, args.workload, args.requests, args.max_tokens)
    rows = args.batch_size
    print(f"{args.workload}, {args.requests} requests of {args.max_tokens} tokens, batch {rows}")
    print(
        "| contender | tokens/s | pass s | prefill s | prompt tokens prefilled | steps | plain step ms |"
        " its forward ms | offers ms | forward ms by width |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.contenders.split(","):
        uses_draft, model_free = DRAFTS[name]
        config = DecodingConfig(
            batch_size=rows,
            model_free=model_free,
            probe_interval=args.probe_interval,
            num_speculative_tokens=args.k,
            fixed_k=args.fixed_k,
        )

        def engine(policy=None, config=config, uses_draft=uses_draft):
            draft = pair.draft if uses_draft else None
            return SpeculativeEngine(pair.target, pair.tokenizer, draft, config, policy=policy)

        warm = engine()
        list(warm.generate(requests[:rows]))
        timed = engine(warm.policy)
        started = time.perf_counter()
        tokens = sum(len(result.token_ids) for result in timed.generate(requests))
        seconds = time.perf_counter() - started
        stats = timed.stats
        means = stats.mean_seconds()

        def ms(key: str, means=means) -> str:
            return f"{means[key] * 1e3:.2f}" if key in means else "-"

        widths = sorted(
            int(key.split(":")[1].split("@")[0])
            for key in means
            if key.startswith("target:") and key.endswith(f"@{rows}")
        )
        by_width = " ".join(f"{w}:{ms(f'target:{w}@{rows}')}" for w in widths)
        offered = timed.policy.t_offer[rows].value if rows in timed.policy.t_offer else None
        offers = "-" if offered is None else f"{offered * 1e3:.2f}"
        print(
            f"| {name} | {tokens / seconds:.1f} | {seconds:.3f} | {stats.time_prefill_s:.3f} | "
            f"{stats.prefill_tokens} of {stats.prefill_tokens + stats.prompt_tokens_reused} | {stats.num_steps} | "
            f"{ms(f'step:0@{rows}')} | {ms(f'target:1@{rows}')} | {offers} | "
            f"{by_width} |"
        )


if __name__ == "__main__":
    main()
