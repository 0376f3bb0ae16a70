"""Where the time of plain decoding goes, specq target-only against HF batched `generate`, alternating.

    python benchmarks/forward_profile.py [--prompts 12] [--batch-size 1] [--rounds 2]

Every call of the target's `forward` is timed (prefill calls, with more than one token a row, apart
from single-token decode calls); what is left of each pass's wall time is bookkeeping outside the
model. Same demo pair, prompts and settings as `specq bench` (greedy, 64 tokens).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    from specq.bench import hf_baselines
    from specq.bench.runner import prompt_token_ids
    from specq.decoding import DecodingConfig, GenerationRequest, SamplingParams, SpeculativeEngine
    from specq.models.demo import build_demo_models
    from specq.models.loading import load_pair

    demo = build_demo_models()
    pair = load_pair(str(demo.target_dir), None, "cpu", None)
    model = pair.target
    _, prompts = prompt_token_ids(pair.tokenizer, args.prompts, 256)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    requests = [GenerationRequest(i, tuple(p), params) for i, p in enumerate(prompts)]
    engine = SpeculativeEngine(model, pair.tokenizer, None, DecodingConfig(batch_size=args.batch_size))
    eos = engine.eos_token_ids
    config = hf_baselines.generation_config(params, pair.tokenizer.pad_token_id or min(eos), eos)

    timed = {"decode_s": 0.0, "decode_calls": 0, "prefill_s": 0.0}
    forward = model.forward

    def timed_forward(*a, **kw):
        began = time.perf_counter()
        out = forward(*a, **kw)
        seconds = time.perf_counter() - began
        if kw["input_ids"].shape[1] > 1:
            timed["prefill_s"] += seconds
        else:
            timed["decode_s"] += seconds
            timed["decode_calls"] += 1
        return out

    model.forward = timed_forward
    runs = {
        "specq": lambda: sum(len(r.token_ids) for r in engine.generate(requests)),
        "hf": lambda: hf_baselines.batched_generate(model, prompts, args.batch_size, config, eos).tokens,
    }
    for run in runs.values():  # warm-up
        run()
    for round_ in range(1, args.rounds + 1):
        rates = {}
        for name, run in runs.items():
            timed.update(decode_s=0.0, decode_calls=0, prefill_s=0.0)
            began = time.perf_counter()
            tokens = run()
            wall = time.perf_counter() - began
            rest = wall - timed["decode_s"] - timed["prefill_s"]
            rates[name] = tokens / wall
            print(
                f"round {round_} {name:5}: {tokens} tokens, {rates[name]:.1f} tokens/s; "
                f"{timed['decode_calls']} decode forwards of {timed['decode_s'] / timed['decode_calls'] * 1e3:.3f} ms; "
                f"prefill {timed['prefill_s'] / tokens * 1e3:.3f} ms a token; "
                f"outside the model {rest / tokens * 1e3:.3f} ms a token"
            )
        print(f"round {round_} specq / hf: {rates['specq'] / rates['hf']:.3f}x")


if __name__ == "__main__":
    main()
