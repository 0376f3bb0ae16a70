"""`--compile auto`'s measurement taken several times in one process, to see whether its decision holds
(issue 40): a `--compile on` load of the pair, then each compiled model's decode step timed against
eager as a first process times it once (`decoding.compiled._measure_speedup`, interleaved rounds), and
`compile_speedups.decide` on each measurement.

    python benchmarks/auto_stability.py --target T [--draft D] [--threads 2] [--times 3]

Run it once on an idle machine and once with the other cores busy; nothing is recorded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft")
    parser.add_argument("--threads", type=int, default=None, help="torch threads [default: torch's]")
    parser.add_argument("--times", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    import torch

    from specq.decoding.compile_speedups import decide
    from specq.decoding.compiled import _measure_speedup
    from specq.decoding.hf_model import eager_forward
    from specq.models.loading import load_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    pair = load_pair(args.target, args.draft, "cpu", None, compile="on", measure_at_load=False)
    models = {"target": pair.target, "draft": pair.draft}
    for role, outcome in pair.compiled.items():
        print(f"{role}: {outcome.summary()}", flush=True)
        if not outcome.compiled:
            continue
        compiled = models[role]
        for time_ in range(1, args.times + 1):
            started = time.perf_counter()
            with torch.inference_mode():
                measurement = _measure_speedup(eager_forward(compiled).model, compiled, pair.first_forwards[role])
            decision = "compile" if decide(measurement).compile else "eager"
            print(
                f"{role} measurement {time_}: {measurement.describe()} -> {decision} "
                f"({time.perf_counter() - started:.1f}s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
