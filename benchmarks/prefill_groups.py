"""What prefilling rows of similar length together saves (decoding/prefill_groups.py).

    python benchmarks/prefill_groups.py [--workload continuation] [--batch-size 16] [--requests 64]
        [--repeats 6]

The demo pair and the prompts of `specq bench --workloads` (bench/workloads.py). For each model, the
prompts are prefilled `--batch-size` at a time, as a batch admits them, in four ways taken in turns
(medians of `--repeats`): one forward padded to the longest prompt (specq before d07e669); in the
groups `length_groups` cuts with a forward's fixed cost of 16, 64 and 256 tokens; and in the groups
the model's own fitted cost gives (what the engine does), after one warm-up round that fits it. Prints
milliseconds, forwards and padded tokens per round, against the prompts' real tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch


def _prefill_round(lm: Any, batches: list[list[list[int]]], forward_tokens: float | None) -> tuple[float, int, int]:
    """Seconds, forwards and padded tokens of one round over every batch: one padded forward a batch
    (`forward_tokens` None), else `length_groups` at that fixed cost."""
    from specq.decoding.hf_model import LAST_ONLY
    from specq.decoding.prefill_groups import length_groups

    started, forwards, padded = time.perf_counter(), 0, 0
    for batch in batches:
        lengths = np.array([len(p) for p in batch])
        cache = lm.new_cache(len(batch), int(lengths.max()))
        whole = [np.arange(len(batch))]
        for group in whole if forward_tokens is None else length_groups(lengths, forward_tokens):
            width = int(lengths[group].max())
            ids = torch.tensor([batch[i] + [0] * (width - len(batch[i])) for i in group])
            with lm.prefill_cost.timing(ids.numel()):
                lm.prefill(cache, torch.from_numpy(group), ids, lm.vocab_size, keep=LAST_ONLY)
            forwards, padded = forwards + 1, padded + ids.numel()
    return time.perf_counter() - started, forwards, padded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="continuation")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()

    from specq.bench.runner import load_bench_pair
    from specq.bench.workloads import greedy_requests
    from specq.decoding.hf_model import RaggedLM

    pair, *_ = load_bench_pair(None, None, "cpu", None, None, lambda line: None, "off")
    prompts = [list(r.prompt_token_ids) for r in greedy_requests(pair.tokenizer, args.workload, args.requests, 8)]
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    real = sum(map(len, prompts))
    print(
        f"{args.workload}: {len(prompts)} prompts of {min(map(len, prompts))} to {max(map(len, prompts))} tokens"
        f" ({real} in all), prefilled {args.batch_size} at a time; medians of {args.repeats} rounds"
    )
    print("| model | groups | ms a round | forwards | padded tokens | padded / real |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, model in (("target", pair.target), ("draft", pair.draft)):
        lm = RaggedLM(model)

        ways: dict[str, float | None] = {"one padded forward": None, "cost 16": 16.0, "cost 64": 64.0}
        ways["cost 256"] = 256.0
        with torch.inference_mode():
            _prefill_round(lm, batches, 64.0)  # warm-up, and prefills of several sizes for the fit
            ways["fitted"] = lm.prefill_cost.overhead_tokens()
            rounds: dict[str, list[tuple[float, int, int]]] = {way: [] for way in ways}
            for _ in range(args.repeats):
                for way, tokens in ways.items():
                    rounds[way].append(_prefill_round(lm, batches, tokens))
        for way, runs in rounds.items():
            label = f"fitted ({ways[way]:.0f} tokens)" if way == "fitted" else way
            ms = statistics.median(run[0] for run in runs) * 1000
            _, forwards, padded = runs[0]
            print(f"| {name} | {label} | {ms:.0f} | {forwards} | {padded} | {padded / real:.2f} |")


if __name__ == "__main__":
    main()
