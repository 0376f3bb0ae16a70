"""Eager against compiled forwards (`--compile`), side by side in one run: each model's whole forward
of a 64-token prompt and its decode step of one token over a 64-token cache at batch 1, both through
the engine's own forward (decoding/hf_model.py's RaggedLM), and the engine end to end with the draft
at batch 1 and 16; interleaved rounds, medians. For the 64-token forward it also times the model's
linear layers alone on 64 rows: arithmetic that compiling leaves as it is, so what is left of the
forward beside it is what the compiler could win.

    python benchmarks/compiled_forwards.py [--backend inductor] [--rounds 3] [--prompts 16] [--static-shapes]

Same demo pair, held-out prompts and settings as `specq bench` (greedy, 64 tokens, K = 4, adaptive
k). The compile (the warm-up of decoding.compiled) is timed apart; a second run in a new process reads
inductor's cache from specq's data directory and pays much less. Every compiled output is checked
token for token against eager. `--static-shapes`: the compiled engine decodes on the static-shape path
(decoding/static_shapes.py, what CUDA graphs need), so the table says what that path costs or gains
on this machine without them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--static-shapes", action="store_true", help="the compiled engine on static shapes")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    import torch

    from specq.bench.roofline import FORWARD_REPEATS, FORWARD_WARMUP, decode_forward_seconds
    from specq.bench.runner import prompt_token_ids
    from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
    from specq.decoding.compiled import compile_model
    from specq.decoding.hf_model import RaggedLM
    from specq.models.demo import build_demo_models
    from specq.models.loading import load_pair

    demo = build_demo_models()
    pair = load_pair(str(demo.target_dir), str(demo.draft_dir), "cpu", None)
    eager = {"target": pair.target, "draft": pair.draft}
    compiled = {}
    for name, model in eager.items():
        compiled[name], outcome = compile_model(model, name, "on", backend=args.backend)  # type: ignore[arg-type]
        print(f"compile {name}: {outcome.seconds:.1f}s", flush=True)

    _, prompts = prompt_token_ids(pair.tokenizer, args.prompts, 256)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    requests = [GenerationRequest(i, tuple(p), params) for i, p in enumerate(prompts)]

    def forward_s(model) -> float:
        """Median seconds of a whole forward of one 64-token prompt, every position's logits, as the engine
        runs a prefill: one cache for all of them, after warm-ups (a fresh cache's first write is a graph
        of its own, decoding/kv_cache.py's lazy initialisation, not the forward's cost)."""
        lm = RaggedLM(model)
        ids = torch.tensor([prompts[0][:64]])
        rows = torch.zeros(1, dtype=torch.long)
        cache = lm.new_cache(rows=1, capacity=ids.shape[1])
        seconds = []
        with torch.inference_mode():
            for _ in range(FORWARD_WARMUP + FORWARD_REPEATS):
                started = time.perf_counter()
                lm.prefill(cache, rows, ids, lm.vocab_size, keep=ids.shape[1])
                seconds.append(time.perf_counter() - started)
        return statistics.median(seconds[FORWARD_WARMUP:])

    def matmuls_s(model) -> float:
        """Median seconds of the forward's linear layers alone, each once on 64 rows: the arithmetic of a
        64-token forward that compiling leaves as it is (the same GEMMs either way)."""
        weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
        inputs = [torch.randn(64, w.shape[1], dtype=w.dtype) for w in weights]
        seconds = []
        with torch.inference_mode():
            for _ in range(FORWARD_WARMUP + FORWARD_REPEATS):
                started = time.perf_counter()
                for x, w in zip(inputs, weights, strict=True):
                    torch.nn.functional.linear(x, w)
                seconds.append(time.perf_counter() - started)
        return statistics.median(seconds[FORWARD_WARMUP:])

    def engine_run(models, batch_size: int) -> tuple[float, dict[int, list[int]]]:
        static = args.static_shapes and models is compiled
        config = DecodingConfig(num_speculative_tokens=4, batch_size=batch_size, static_shapes=static)
        engine = SpeculativeEngine(models["target"], pair.tokenizer, models["draft"], config)
        started = time.perf_counter()
        out = {r.key: r.token_ids for r in engine.generate(requests)}
        tokens = sum(len(t) for t in out.values())
        return tokens / (time.perf_counter() - started), out

    rows: dict[str, list[float]] = {}
    for name in ("draft", "target"):  # warm both paths for the forwards too
        forward_s(eager[name]), forward_s(compiled[name])
    for batch_size in (1, 16):
        engine_run(eager, batch_size), engine_run(compiled, batch_size)
    for _ in range(args.rounds):
        for name in ("draft", "target"):
            for path, models in (("eager", eager), ("compiled", compiled)):
                rows.setdefault(f"{name} forward {path}", []).append(forward_s(models[name]))
                rows.setdefault(f"{name} step {path}", []).append(decode_forward_seconds(models[name]))
            rows.setdefault(f"{name} matmuls", []).append(matmuls_s(eager[name]))
        for batch_size in (1, 16):
            rate, reference = engine_run(eager, batch_size)
            rate_c, out = engine_run(compiled, batch_size)
            assert out == reference, "compiled output differs from eager"
            rows.setdefault(f"e2e b{batch_size} eager", []).append(rate)
            rows.setdefault(f"e2e b{batch_size} compiled", []).append(rate_c)
    medians = {key: statistics.median(values) for key, values in rows.items()}
    print("| measure | eager | compiled | compiled / eager speed |")
    print("| --- | --- | --- | --- |")
    for name in ("draft", "target"):
        for what, label in (("forward", "forward, batch 1, 64 tokens"), ("step", "decode step, batch 1, 1 token")):
            e, c = medians[f"{name} {what} eager"], medians[f"{name} {what} compiled"]
            print(f"| {name} {label} | {e * 1e3:.3f} ms | {c * 1e3:.3f} ms | {e / c:.2f}x |")
    for batch_size in (1, 16):
        e, c = medians[f"e2e b{batch_size} eager"], medians[f"e2e b{batch_size} compiled"]
        print(f"| engine with draft, batch {batch_size} | {e:.1f} tok/s | {c:.1f} tok/s | {c / e:.2f}x |")
    for name in ("draft", "target"):
        e, c, m = (medians[f"{name} forward eager"], medians[f"{name} forward compiled"], medians[f"{name} matmuls"])
        print(
            f"{name}, 64-token forward: its linear layers' matmuls alone take {m * 1e3:.3f} ms; the rest "
            f"{(e - m) * 1e3:.3f} ms eager, {(c - m) * 1e3:.3f} ms compiled ({(e - m) / (c - m):.2f}x)"
        )


if __name__ == "__main__":
    main()
