"""A model's decode step eager, with its whole forward compiled, and with its decoder layer compiled as
a region (decoding/compiled_regions.py, what `--compile on` does on a CPU): what each compile took in
this process and what each gains, in interleaved rounds (decoding/compile_speedups.py's `measure`: 9
rounds, each side the best of 3 calls, their order alternating), over a 64-token cache at batch 1.

    python benchmarks/compile_regions.py [--target T] [--draft D] [--widths 1,2]

Default: the demo pair. Each compile gets its own copy of the model, so that neither traces the other's
layers. The compiles read and fill inductor's cache in specq's data directory like any load: time
them in a fresh SPECQ_HOME for a first process's figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="a model folder [default: the demo pair's target]")
    parser.add_argument("--draft", help="a second model folder [default: the demo pair's draft, with no --target]")
    parser.add_argument("--widths", default="1,2", help="tokens a timed step verifies, comma-separated")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    import torch

    from specq.decoding.compile_speedups import measure
    from specq.decoding.compiled import FirstForwards, _timed_steps, compile_model
    from specq.models.loading import load_model

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    models = {"target": args.target, "draft": args.draft}
    if args.target is None:
        from specq.models.demo import build_demo_models

        demo = build_demo_models()
        models = {"target": str(demo.target_dir), "draft": str(demo.draft_dir)}
    widths = [int(width) for width in args.widths.split(",")]
    print("| model | compile | compiled in | graphs | step width | over eager: median (quartiles) |", flush=True)
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for role, folder in models.items():
        if folder is None:
            continue
        eager = load_model(folder, "cpu", None)
        compiled = {}
        for how, regions in (("whole forward", "0"), ("decoder layer", "1")):
            os.environ["SPECQ_COMPILE_REGIONS"] = regions
            model = load_model(folder, "cpu", None)
            started = time.perf_counter()
            first = FirstForwards(widths=tuple(widths))
            compiled[how], outcome = compile_model(model, role, "on", first=first, measure_at_load=False)
            compiled_s = time.perf_counter() - started
            print(f"| {role} | {how} | {compiled_s:.1f} s | {outcome.graphs} | | |", flush=True)
        with torch.inference_mode():
            for width in widths:
                for how, forward in compiled.items():
                    runs = _timed_steps((eager, forward), 1, width)
                    for run in runs:  # untimed: a first call at a new cache length may still compile
                        run()
                    got = measure(runs)
                    low, high = got.spread
                    print(f"| {role} | {how} | | | {width} | {got.median:.2f}x ({low:.2f}-{high:.2f}) |", flush=True)
                runs = _timed_steps((compiled["whole forward"], compiled["decoder layer"]), 1, width)
                for run in runs:
                    run()
                got = measure(runs)
                low, high = got.spread
                label = "decoder layer over whole forward"
                print(f"| {role} | {label} | | | {width} | {got.median:.2f}x ({low:.2f}-{high:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
