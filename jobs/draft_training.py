"""`submit --draft train:N[:BUDGET]`: a job that pays for its own draft.

The job's first N requests (in file order) are decoded by the target alone; once they have ended, the
worker that runs the next chunk trains a draft head on their completions (distill/job_head.py) and
stores it with the job (worker/trained_draft.py); the rest of the job speculates with it. Speculation
is lossless, so a request that runs before the head is ready (a chunk another worker takes while the
head trains, or one the head failed to train for) runs with the target alone and gets the same output.
"""

from __future__ import annotations

from dataclasses import dataclass

from specq.budget import Budget

TRAIN_PREFIX = "train:"
# chain tokens (distill/head.py): about 200 steps of 256 chains, a minute of a 2-core CPU on
# SmolLM2-135M and seconds on a GPU; `train:N:BUDGET` gives more
DEFAULT_BUDGET = "200k"
MOST_PROMPT_DIGITS = 18  # N is below the job's request count, far below 10**18


@dataclass(frozen=True)
class DraftTraining:
    prompts: int  # the job's first requests, decoded by the target alone and trained on
    budget: str = DEFAULT_BUDGET  # as `specq draft train --budget` takes it: tokens (200k) or time (5m)

    def __post_init__(self) -> None:
        if self.prompts < 1:
            raise ValueError(f"train:N needs N >= 1 requests to train on, got {self.prompts}")
        Budget.parse(self.budget)  # ValueError with a sentence

    @property
    def parsed_budget(self) -> Budget:
        return Budget.parse(self.budget)

    def describe(self) -> str:
        return f"{TRAIN_PREFIX}{self.prompts}:{self.budget}"

    @classmethod
    def parse(cls, draft: str) -> DraftTraining | None:
        """The training `--draft` asks for; None where it names no training (a model, `ngram`, ...);
        ValueError with a sentence where it is `train:` and malformed."""
        if not draft.startswith(TRAIN_PREFIX):
            return None
        prompts, _, budget = draft[len(TRAIN_PREFIX) :].partition(":")
        if not (prompts.isascii() and prompts.isdigit()):  # isdigit alone takes "²", which int() refuses
            raise ValueError(
                f"--draft {draft!r}: give train:N or train:N:BUDGET, N the requests the draft learns from "
                "(e.g. train:200, train:200:5m)"
            )
        if len(prompts.lstrip("0")) > MOST_PROMPT_DIGITS:  # int() refuses 4,300 digits with a traceback's words
            raise ValueError(f"--draft train:N: N has {len(prompts)} digits, more requests than a job holds")
        return cls(int(prompts), budget or DEFAULT_BUDGET)
