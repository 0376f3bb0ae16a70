"""Compiled forwards on one CUDA device: eager against compiled specq, and transformers' generate
(plain and assisted), at batch 1, 8 and 32, with each model's distance to the memory roofline.

    python benchmarks/gpu_compile.py                 # a ~1B Llama-shape target and a ~100M draft, bf16
    python benchmarks/gpu_compile.py --smoke --device cpu --backend aot_eager [--static-shapes]  # tiny (CI)

The pair is random-initialised (speed does not depend on the weights' values), the draft a noisy copy
of the target's first layers' shape so that it accepts nothing in particular: the table measures
forward cost, not acceptance, so every run is greedy with a fixed k and the acceptance it gets is
printed beside it. The roofline: a batch-1 decode forward must read every weight once, so its floor is
weight bytes / the device's measured copy bandwidth; `fwd / floor` says how far a forward is from it.
On CUDA the compiled forwards replay CUDA graphs and specq decodes them on static shapes
(decoding/static_shapes.py); the script prints how many graphs torch recorded and skipped (a skip: a
forward that ran compiled but without a graph). `--static-shapes` takes the static path on a CPU too,
so the smoke run covers it. Prints one Markdown table; meant to finish in under 10 minutes on an H200.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--smoke", action="store_true", help="tiny models and few tokens: checks the script runs")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--static-shapes", action="store_true", help="the static-shape path off CUDA too")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    import torch
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    from specq.bench import hf_baselines
    from specq.bench.roofline import decode_forward_seconds, forward_floor_seconds, measure_bandwidth, weight_bytes
    from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
    from specq.decoding.compiled import FirstForwards, compile_model, warm_up_decoding

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = {  # (hidden, layers, heads, kv heads, intermediate): ~1.1B and ~110M with a 32k vocabulary
        "target": (2048, 22, 32, 4, 5632),
        "draft": (768, 8, 12, 4, 2048),
    }
    vocab, max_tokens, batch_sizes = 32000, args.max_tokens, [1, 8, 32]
    if args.smoke:
        shapes = {"target": (64, 2, 4, 2, 128), "draft": (32, 1, 4, 2, 64)}
        vocab, max_tokens, batch_sizes = 256, 8, [1, 4]

    def build(name: str) -> LlamaForCausalLM:
        hidden, layers, heads, kv_heads, intermediate = shapes[name]
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            intermediate_size=intermediate,
            max_position_embeddings=2048,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=0,
        )
        model = LlamaForCausalLM(config).to(device=device, dtype=dtype)  # type: ignore[call-arg]
        return model.eval()

    class Tokenizer:  # ids only: the engine decodes text for stop strings, which no request sets
        eos_token_id, bos_token_id = 1, 0

        def decode(self, ids, **_: object) -> str:
            return " ".join(map(str, ids))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    eager = {name: build(name) for name in shapes}
    weights = {name: weight_bytes(model) for name, model in eager.items()}
    compiled, compile_s, outcomes = {}, {}, {}
    first = {"target": FirstForwards(), "draft": FirstForwards(widths=(1,))}  # as load_pair
    for name, model in eager.items():
        compiled[name], outcomes[name] = compile_model(model, name, "on", backend=args.backend, first=first[name])
        compile_s[name] = outcomes[name].seconds
    tokenizer = Tokenizer()
    # every other kind of graph now, so that no timed pass below compiles (a job compiles them lazily)
    compile_s["warm-up decode"] = warm_up_decoding(compiled["target"], compiled["draft"], tokenizer)

    bandwidth = measure_bandwidth(device, weights["target"])

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, vocab, (int(n),), generator=generator).tolist() for n in torch.randint(16, 64, (64,))]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    def specq_rate(models, batch_size: int) -> tuple[float, float]:
        config = DecodingConfig(
            num_speculative_tokens=4, batch_size=batch_size, fixed_k=True, static_shapes=args.static_shapes
        )
        engine = SpeculativeEngine(models["target"], tokenizer, models["draft"], config)
        requests = [GenerationRequest(i, tuple(p), params) for i, p in enumerate(prompts[: 2 * batch_size])]
        sync()
        started = time.perf_counter()
        tokens = sum(len(r.token_ids) for r in engine.generate(requests))
        sync()
        return tokens / (time.perf_counter() - started), engine.stats.acceptance_rate

    hf_config = hf_baselines.generation_config(params, 0, {1})
    rows = []
    for batch_size in batch_sizes:
        specq_rate(eager, batch_size), specq_rate(compiled, batch_size)  # warm-up: kernels, graphs, caches
        eager_rate, acceptance = specq_rate(eager, batch_size)
        compiled_rate, _ = specq_rate(compiled, batch_size)
        chunk = prompts[: 2 * batch_size]
        plain = hf_baselines.batched_generate(eager["target"], chunk, batch_size, hf_config, {1})
        plain_rate = sum(map(len, plain.outputs.values())) / plain.seconds
        assisted_rate = None
        if batch_size == 1:  # transformers' assisted generation takes one sequence at a time
            assisted = hf_baselines.assisted_generate(eager["target"], eager["draft"], chunk, hf_config, {1})
            assisted_rate = sum(map(len, assisted.outputs.values())) / assisted.seconds
        rows.append((batch_size, eager_rate, compiled_rate, plain_rate, assisted_rate, acceptance))

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {device_name}, {dtype}, backend {args.backend}")
    print(
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; compile s: "
        + ", ".join(f"{k} {v:.0f}" for k, v in compile_s.items())
    )
    for name, outcome in outcomes.items():
        print(f"{name} at load: {outcome.summary()}")
    graphs = counters["inductor"]
    static = SpeculativeEngine(
        compiled["target"], tokenizer, compiled["draft"], DecodingConfig(static_shapes=args.static_shapes)
    ).static_shapes
    print(
        f"specq compiled on static shapes: {static}; CUDA graphs: "
        f"{graphs['cudagraph_recorded_non_static_inputs']} non-static inputs recorded, "
        f"{graphs['cudagraph_skips']} graphs skipped"
    )
    for name in shapes:
        floor = forward_floor_seconds(weights[name], bandwidth)
        e, c = decode_forward_seconds(eager[name]), decode_forward_seconds(compiled[name])
        print(
            f"{name}: {weights[name] / 1e9:.2f} GB of weights, floor {floor * 1e3:.2f} ms; batch-1 decode forward "
            f"eager {e * 1e3:.2f} ms ({e / floor:.1f}x floor), compiled {c * 1e3:.2f} ms ({c / floor:.1f}x floor)"
        )
    header = ("batch", "specq eager", "specq compiled", "compiled / eager", "HF generate", "HF assisted", "acceptance")
    print("| " + " | ".join(header) + " |  (tok/s)")
    print("| --- " * len(header) + "|")
    for batch_size, eager_rate, compiled_rate, plain_rate, assisted_rate, acceptance in rows:
        assisted_text = "-" if assisted_rate is None else f"{assisted_rate:.1f}"
        print(
            f"| {batch_size} | {eager_rate:.1f} | {compiled_rate:.1f} | {compiled_rate / eager_rate:.2f}x | "
            f"{plain_rate:.1f} | {assisted_text} | {acceptance:.2f} |"
        )


if __name__ == "__main__":
    main()
