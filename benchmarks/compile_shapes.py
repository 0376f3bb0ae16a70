"""How a compiled decode step's time depends on what is compiled and on how its shapes are: eager; the
model alone with automatic dynamic shapes (torch's default: a dimension turns symbolic once it has
varied), its attention masks and position ids built eagerly around it (`--compile` before d878e03);
the same with the masks and position ids built inside the graph (hf_model.ColumnsForward, what
`--compile` compiles now); and that on static shapes with the attention window rounded up to a
64-column bucket (the static-shape path of issue 13: one graph per rows and width, the key length
fixed by the bucket, masks hiding the extra columns).

    python benchmarks/compile_shapes.py [--shapes 1x1,1x5,16x1,16x5] [--rounds 2]

The demo pair, fp32, inductor. For each model and rows x width shape, the step runs through the
engine's own forward (decoding/hf_model.py) over a 512-column cache, its window cycling through 120-123
columns as decoding lengthens it. Each variant is warmed up on other windows first, so its compiles are
paid before timing (printed: outside, inside, static); then medians of 60 passes over the four windows, the least of
`--rounds` rounds. Every variant's logits are checked against eager's.
"""

from __future__ import annotations

import argparse
import statistics
import time

_BUCKET = 64  # columns the static variant's attention window is rounded up to
_WINDOWS = (120, 121, 122, 123)
_WARM_WINDOWS = (100, 110, 128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1x1,1x5,16x1,16x5", help="rows x width of a step")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import torch
    import torch._dynamo

    from specq.decoding.hf_model import LAST_ONLY, ColumnsForward, RaggedLM
    from specq.models.demo import build_demo_models
    from specq.models.loading import load_pair

    torch._dynamo.config.recompile_limit = 64
    demo = build_demo_models()
    pair = load_pair(str(demo.target_dir), str(demo.draft_dir), "cpu", None)
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]

    def steps(model, eager, rows: int, width: int, windows, bucketed: bool, passes: int) -> tuple[float, torch.Tensor]:
        """Median ms of a step, and the last step's logits; the prompt is prefilled eagerly."""
        lm = RaggedLM(model)
        cache = lm.new_cache(rows, 512)
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, lm.vocab_size, (rows, 200), generator=generator)
        inputs = torch.randint(0, lm.vocab_size, (rows, width), generator=generator)
        times, logits = [], None
        with torch.inference_mode():  # as the engine decodes
            RaggedLM(eager).prefill(cache, torch.arange(rows), prompt, lm.vocab_size, keep=LAST_ONLY)
            for _ in range(passes):
                for window in windows:
                    columns = (torch.full((rows, 1), window - width) + torch.arange(width)).contiguous()
                    read = -(-window // _BUCKET) * _BUCKET if bucketed else window
                    started = time.perf_counter()
                    logits = lm.step(cache, inputs, columns, read, lm.vocab_size)
                    times.append(time.perf_counter() - started)
        assert logits is not None
        return statistics.median(times) * 1e3, logits

    print("| model | rows x width | eager ms | masks outside ms | masks inside ms | static, bucketed ms | compile s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, model in (("draft", pair.draft), ("target", pair.target)):
        assert model is not None  # the demo pair has both
        variants = {
            "eager": (model, False),
            "outside": (torch.compile(model), False),
            "inside": (torch.compile(ColumnsForward(model)), False),
            "static": (torch.compile(ColumnsForward(model), dynamic=False), True),
        }
        for rows, width in shapes:
            compile_s = {}
            for variant, (candidate, bucketed) in variants.items():
                started = time.perf_counter()
                steps(candidate, model, rows, width, _WARM_WINDOWS + _WINDOWS, bucketed, 1)
                compile_s[variant] = time.perf_counter() - started
            _, reference = steps(model, model, rows, width, _WINDOWS, False, 1)
            medians = {}
            for variant, (candidate, bucketed) in variants.items():
                runs = [steps(candidate, model, rows, width, _WINDOWS, bucketed, 15) for _ in range(args.rounds)]
                gap = float((runs[0][1] - reference).abs().max())
                assert gap < 1e-3, f"{name} {variant}: logits differ from eager by {gap}"
                medians[variant] = min(ms for ms, _ in runs)
            print(
                f"| {name} | {rows}x{width} | {medians['eager']:.3f} | {medians['outside']:.3f} | "
                f"{medians['inside']:.3f} | {medians['static']:.3f} | "
                f"{compile_s['outside']:.0f}, {compile_s['inside']:.0f}, {compile_s['static']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
