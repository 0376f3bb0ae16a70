"""`specq draft train`'s held-out measurement again, on a finished draft folder, with more rounds or
another temperature: the same held-out prompts (the same `--heldout` and `--train-seed` split of the
same file), `distill.evaluate.evaluate_draft` as the command calls it: target-only, the draft (K adaptive
and fixed) and the draft beside prompt lookup and the suffix index (`--model-free suffix`), rounds taking
turns.

    python benchmarks/heldout_eval.py --target T --data PROMPTS.jsonl --draft DIR [--heldout 32]
        [--max-tokens 48] [--batch-sizes 1,16] [--repeats 5] [--temperature 0.7 --seed 1234]
        [--compile on]   # target-only and the draft over the compiled target
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--draft", required=True)
    parser.add_argument("--heldout", type=int, default=None, help="as the run's --heldout")
    parser.add_argument("--train-seed", type=int, default=0, help="as the run's --train-seed")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None, help="the sampling seed")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="off")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    from specq.decoding.types import SamplingParams
    from specq.distill.corpus import prepare_prompts, split
    from specq.distill.evaluate import evaluate_draft, summary_lines
    from specq.distill.settings import DistillSettings
    from specq.jobs.chat_template import ChatLines
    from specq.jobs.inputs import iter_request_specs
    from specq.models.loading import load_tokenizer

    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    settings = DistillSettings(
        target=args.target,
        data=args.data,
        sampling=sampling,
        heldout=args.heldout,
        seed=args.train_seed,
        eval_batch_sizes=tuple(int(size) for size in args.batch_sizes.split(",")),
        eval_repeats=args.repeats,
        num_speculative_tokens=args.k,
        eval_compile=args.compile,
    )
    tokenizer = load_tokenizer(args.target)
    with ChatLines(args.target, None, lambda _: tokenizer) as chat_lines:
        specs = list(iter_request_specs(args.data, None, name=args.data, prepare=chat_lines))
    prompts = prepare_prompts(iter(specs), tokenizer, sampling, args.data)
    _, heldout = split(len(prompts), settings.heldout_count(len(prompts)), settings.seed)
    heldout_ids = [prompts[i].request.prompt_token_ids for i in heldout]
    report = evaluate_draft(settings, args.draft, heldout_ids, print)
    for line in summary_lines(report):
        print(line)


if __name__ == "__main__":
    main()
