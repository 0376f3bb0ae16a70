"""What the adaptive-k policy expected of each k it chose, against what those steps then gave.

    python benchmarks/policy_trace.py [--workload continuation] [--batch-size 16] [--contender suffix]
        [--requests 64] [--max-tokens 32] [--passes 3]

The engines of `specq bench --workloads` (bench/draft_axis.py: the demo pair, greedy, the contender's
default K), one warm-up pass, then `--passes` timed passes sharing the warm-up's policy, each with an
empty suffix index, in turns with target-only's and with the contender's engine never speculating
("resting": its policy never asks for offers, so every step is plain, as between a resting policy's
probes). Resting against target-only is what the policy's off switch costs: the proposer's
bookkeeping on a batch that does not speculate. First, where each pass's time went: prefill, the
decode steps (what the policy times) and the rest (admission, finishing, feeding the index), with the
admissions it ran (its first and each refill) and its idle row-steps (each step's free rows). Then,
for each k chosen at the full batch: the steps that took it; the tokens a row the policy expected of
it when it chose it, and those the steps gave; its step time over a plain step's, as the policy
estimated it and as measured (the median step at that k over target-only's mean step at the full
batch). Where the expected gain (tokens over time) exceeds the realised one, the policy speculated
on estimates the steps did not bear out.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from typing import Any

import numpy as np

from specq.decoding.k_policy import SpeculationPolicy, _draft_depth


class RestingPolicy(SpeculationPolicy):
    """The engine's policy resting on every step: no offers, no speculation."""

    def wants_offers(self, rows: int) -> bool:
        return False


class TracingPolicy(SpeculationPolicy):
    """The engine's policy, keeping for each step what it expected at its choice and what happened."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps_seen: list[dict[str, Any]] = []
        self._pending: dict[str, Any] = {}

    def choose(self, rows, limit, offers=None, sources=None, tokens_left=None):
        k = super().choose(rows, limit, offers, sources, tokens_left)
        top = min(self.max_k, limit)
        live = rows if offers is None else offers.size
        if top > 0 and live:
            expected = self._expected_batch_tokens(top, offers, sources)
            times = self.step_times(rows, top, draft_depth=_draft_depth(offers, sources))
            if np.isfinite(times[k]) and np.isfinite(times[0]):
                self._pending = {"expected": expected[k] / live, "time_ratio": times[k] / times[0]}
        return k

    def observe_acceptance(self, num_accepted, num_draft, sources=None):
        # the engine reports a step's acceptance before its times
        self._pending["realised"] = float(num_accepted.mean()) + 1.0
        super().observe_acceptance(num_accepted, num_draft, sources)

    def observe_step(self, rows, k, t_draft, t_target, t_total, **kwargs):
        self.steps_seen.append({"rows": rows, "k": k, "seconds": t_total, **self._pending})
        self._pending = {}
        super().observe_step(rows, k, t_draft, t_target, t_total, **kwargs)


def _count_refills_and_idle_rows(engine: Any) -> tuple[list[int], list[int]]:
    """Lists `engine` fills as it decodes: the rows each admission (the first, then each refill) took, and
    each step's free rows (idle row-steps), read at its admissions and steps."""
    refills: list[int] = []
    idle: list[int] = []
    admit, step = engine._admit, engine._step

    def counted_admit(batch: Any, admitted: list[Any]) -> Any:
        refills.append(len(admitted))
        return admit(batch, admitted)

    def counted_step(batch: Any) -> Any:
        idle.append(batch.rows - batch.num_live())
        return step(batch)

    engine._admit, engine._step = counted_admit, counted_step
    return refills, idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="continuation")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--contender", default="suffix")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()

    from specq.bench.draft_axis import DRAFTS
    from specq.bench.runner import load_bench_pair
    from specq.bench.workloads import greedy_requests
    from specq.decoding import DecodingConfig, SpeculativeEngine

    pair, *_ = load_bench_pair(None, None, "cpu", None, None, lambda line: None, "off")
    requests = greedy_requests(pair.tokenizer, args.workload, args.requests, args.max_tokens)
    rows = args.batch_size
    uses_draft, model_free = DRAFTS[args.contender]
    config = DecodingConfig(batch_size=rows, model_free=model_free)

    def engine(policy: SpeculationPolicy | None = None) -> SpeculativeEngine:
        return SpeculativeEngine(pair.target, pair.tokenizer, pair.draft if uses_draft else None, config, policy=policy)

    def plain_engine() -> SpeculativeEngine:
        return SpeculativeEngine(pair.target, pair.tokenizer, None, DecodingConfig(batch_size=rows))

    probe = engine()  # the contender's K and mode, as `specq run` sets them
    policy = TracingPolicy(probe.max_k, fixed=config.fixed_k, probe_interval=config.probe_interval)
    list(engine(policy).generate(requests[:rows]))
    list(plain_engine().generate(requests[:rows]))
    policy.steps_seen.clear()

    def resting_engine() -> SpeculativeEngine:
        return engine(RestingPolicy(probe.max_k, fixed=False))

    list(resting_engine().generate(requests[:rows]))
    resting = f"{args.contender}, resting"
    makers = (("target_only", plain_engine), (args.contender, lambda: engine(policy)), (resting, resting_engine))
    passes: dict[str, list[tuple[float, ...]]] = {name: [] for name, _ in makers}
    plain_steps: list[float] = []  # target-only's steps at the full batch, the reference for every k
    for _ in range(args.passes):  # in turns, as `specq bench` times them
        for name, make in makers:
            timed = make()
            refills, idle = _count_refills_and_idle_rows(timed)
            started = time.perf_counter()
            tokens = sum(len(result.token_ids) for result in timed.generate(requests))
            seconds = time.perf_counter() - started
            stats = timed.stats
            stepping = sum(t for key, t in stats.timed_seconds.items() if key.startswith("step:"))
            passes[name].append(
                (tokens / seconds, seconds, stats.time_prefill_s, stepping, stats.num_steps, len(refills), sum(idle))
            )
            if name == "target_only":
                plain_steps.append(stats.mean_seconds()[f"step:0@{rows}"])
    print(
        f"{args.contender} on {args.workload}, batch {rows}: {args.passes} passes each of {args.requests} requests"
        f" of {args.max_tokens} tokens, in turns with target-only and the contender resting (medians; vs target-only:"
        " of the rounds' ratios; other = the pass less prefill and steps)"
    )
    print(
        "| contender | tokens/s of each pass | vs target-only | pass s | prefill s | steps s | other s | steps |"
        " admissions | idle rows |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, runs in passes.items():
        ratio = statistics.median(run[0] / plain[0] for run, plain in zip(runs, passes["target_only"], strict=True))
        seconds, prefill, stepping, count, admissions, idle_rows = (
            statistics.median(run[i] for run in runs) for i in range(1, 7)
        )
        other = statistics.median(run[1] - run[2] - run[3] for run in runs)
        print(
            f"| {name} | {', '.join(f'{run[0]:.1f}' for run in runs)} | {ratio:.3f}x | {seconds:.3f} | {prefill:.3f} | "
            f"{stepping:.3f} | {other:.3f} | {count:.0f} | {admissions:.0f} | {idle_rows:.0f} |"
        )
    print()
    by_k: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for step in policy.steps_seen:
        if step["rows"] == rows:
            by_k[step["k"]].append(step)
    plain = statistics.median(plain_steps)
    print(
        "| k | steps | tokens a row expected | realised | step time / plain, expected | measured |"
        " gain expected | realised |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for k, steps in sorted(by_k.items()):
        chosen = [s for s in steps if "expected" in s]
        measured = statistics.median(s["seconds"] for s in steps) / plain
        realised = float(np.mean([s.get("realised", 1.0) for s in steps]))
        if not chosen:
            print(f"| {k} | {len(steps)} | - | {realised:.2f} | - | {measured:.2f} | - | {realised / measured:.2f} |")
            continue
        expected = float(np.mean([s["expected"] for s in chosen]))
        time_ratio = float(np.median([s["time_ratio"] for s in chosen]))
        print(
            f"| {k} | {len(steps)} | {expected:.2f} | {realised:.2f} | {time_ratio:.2f} | {measured:.2f} | "
            f"{expected / time_ratio:.2f} | {realised / measured:.2f} |"
        )


if __name__ == "__main__":
    main()
