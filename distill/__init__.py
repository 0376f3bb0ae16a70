"""`specq draft train`: distil a draft model for a target from the target's own outputs.

The phases, each resumable from the output folder's work state (distill/workdir.py):

    decode    the target alone decodes the training prompts with specq's engine (distill/corpus.py);
    train     a small draft, sized from the target, follows the target's distributions on those
              sequences (distill/sizing.py, distill/trainer.py: DistillSpec, Zhou et al. 2024);
    evaluate  the draft against target-only on held-out prompts, as `specq bench` measures
              (distill/evaluate.py).

distill/run.py strings them together; the CLI (cli/draft.py) only parses and shows progress.
"""
