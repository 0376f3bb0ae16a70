"""Pilots for a draft head (issue 39): train `distill/head.py`'s head on stored completions and report its
acceptance on held-out ones as it trains, without the engine, so that data sizes and head shapes can be
compared in minutes.

    python benchmarks/head_pilots.py --target T --sequences DIR/.specq-draft/sequences.jsonl \\
        [--train 936] [--heldout 64] [--chain-tokens 500k] [--intermediate 2304] [--feature-weight 0]
        [--threads 1] [--states-cache STATES.pt] [--save HEAD_DIR]

SEQUENCES is a `specq draft train` work folder's decoded completions (kept there after the run). The
acceptance is simulated greedy verification at K = 4 along each held-out completion: from its first
token the head drafts K tokens from the target's hidden state, the leading ones equal to the
completion's are accepted, the target's next token follows, and so on; accepted over drafted.
`--states-cache` keeps the hidden states read (in fp32) for the next pilot on the same split;
`--save` writes the trained head as `--draft` takes it, for the engine's own measurement.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--sequences", required=True, type=Path)
    parser.add_argument("--train", type=int, default=228, help="completions trained on")
    parser.add_argument("--heldout", type=int, default=64, help="completions measured on")
    parser.add_argument("--split-seed", type=int, default=1)
    parser.add_argument("--chain-tokens", default="500k", help="the training budget, as --budget's tokens")
    parser.add_argument("--intermediate", type=int, default=None, help="the head's step width [default: 2H]")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("-k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--every", type=int, default=200, help="steps between measurements")
    parser.add_argument("--feature-weight", type=float, default=None, help="[default: the trainer's]")
    parser.add_argument("--states-cache", type=Path, default=None, help="keep the hidden states read here")
    parser.add_argument(
        "--extra-sequences",
        type=Path,
        default=None,
        help="more completions of the same prompts, in the same order (e.g. sampled): trained on beside SEQUENCES'",
    )
    parser.add_argument("--save", type=Path, default=None, help="write the trained head here, as `--draft` takes it")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

    import torch

    from specq.budget import Budget
    from specq.distill.corpus import load_sequences
    from specq.distill.head import HeadTrainer, new_head, target_states
    from specq.models.loading import load_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sequences = load_sequences(args.sequences)
    order = list(range(len(sequences)))
    random.Random(args.split_seed).shuffle(order)
    heldout = [sequences[i] for i in order[: args.heldout]]
    trained = [sequences[i] for i in order[args.heldout : args.heldout + args.train]]
    if args.extra_sequences:  # never a held-out prompt's
        extra = load_sequences(args.extra_sequences)
        trained += [extra[i] for i in order[args.heldout : args.heldout + args.train]]
    target = load_model(args.target, "cpu", "float32")
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    started = time.perf_counter()
    if args.states_cache and args.states_cache.exists():
        measured_on, chains = torch.load(args.states_cache, weights_only=False)
    else:
        measured_on, chains = target_states(target, heldout), target_states(target, trained)
        if args.states_cache:
            torch.save((measured_on, chains), args.states_cache)
    print(
        f"hidden states: {chains.tokens.numel()} trained on, {measured_on.tokens.numel()} held out, "
        f"{time.perf_counter() - started:.0f}s",
        flush=True,
    )
    head = new_head(target, trained, args.vocab, args.intermediate)
    budget = Budget.parse(args.chain_tokens)
    weighted = {} if args.feature_weight is None else {"feature_weight": args.feature_weight}
    trainer = HeadTrainer(head, chains, budget, depth=args.k, learning_rate=args.learning_rate, **weighted)

    @torch.no_grad()
    def acceptance() -> float:
        head.eval()
        accepted = drafted = offset = 0
        for sequence in heldout:
            count = len(sequence.completion)
            states = measured_on.states[offset : offset + count]
            tokens = measured_on.tokens[offset : offset + count]
            offset += count
            at = 0
            while at < count - 1:
                k = min(args.k, count - 1 - at)
                state, token, matched = states[at : at + 1], tokens[at : at + 1], 0
                for i in range(k):
                    state = head.step(state, token)
                    token = head.vocab_ids[head.logits(state).argmax(dim=-1)]
                    if int(token) != int(tokens[at + 1 + i]):
                        break
                    matched += 1
                accepted, drafted, at = accepted + matched, drafted + k, at + matched + 1
        head.train()
        return accepted / drafted

    started = time.perf_counter()
    while trainer.state.fraction(budget) < 1:
        trainer.step()
        if trainer.state.step % args.every == 0 or trainer.state.fraction(budget) >= 1:
            print(
                f"step {trainer.state.step} {time.perf_counter() - started:.0f}s acceptance {acceptance():.3f}",
                flush=True,
            )
    if args.save:
        from specq.models.loading import load_tokenizer

        head.eval()
        head.save(args.save)
        load_tokenizer(args.target).save_pretrained(args.save)


if __name__ == "__main__":
    main()
