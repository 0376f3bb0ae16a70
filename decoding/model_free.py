"""Model-free proposers: prompt lookup alone, with the job's suffix index, or beside a draft model.

- `ModelFreeProposer`: per row, the tokens that followed the longest earlier match of the row's
  suffix in its own sequence (decoding/prompt_lookup.py; Saxena 2023, vLLM's `ngram`) and, with a
  `SuffixIndex`, the most frequent continuation in the job's finished outputs (decoding/suffix_index.py;
  SuffixDecoding, Oliaro et al. 2025), whichever expects more tokens at its length by the policy's
  acceptance of each. A row without a match offers nothing and
  costs only its verified token.
  The index is fed outputs, each after the last few tokens of its prompt, not whole prompts: a row's
  own prompt is prompt lookup's to copy from, as SuffixDecoding keeps a per-request tree for it, and
  the job's other prompts, where they share a template, repeat what the row's own prompt holds. Fed
  every prompt too, the index cost a compute-bound batch time where it was never used, and the suffix
  contender was slower on every workload and batch size measured (docs/benchmark-log/2026-12.md, "The
  draft axis: target-only, draft model, ngram, suffix, hybrid").
- `HybridProposer`: a draft model and a model-free proposer within ONE verify pass. Each step plans
  by the policy's expected tokens per second (`SpeculationPolicy.best_mix`, decoding/k_policy.py),
  which prices the draft model's forwards and the verify width: over every verify width k and draft
  depth d, each row takes whichever proposal expects more at that k and d (its lookup capped at k, the
  draft model's proposal at d), and the step takes the (k, d) of the most tokens per second. So a long
  lookup counts at the width the whole batch will verify, not at its own length; the draft model runs
  only as many forwards as its rows pay for, none where lookups alone pay more; and the draft model
  alone and lookups alone are plans of the same weighing, so the mix is never estimated below either.
  Rows are looked up only on steps where a lookup could be taken at all, judged from the best a lookup
  could be (as long as the row may take, at the best looked-up acceptance measured; judged only after a
  step whose plan took no lookup, since where lookups are taken step after step the judging cost as
  much as the lookups), and where lookups have paid for their own time: each step that looks up, the
  policy keeps what its plan promised, the lookups' seconds added to its step, over what the draft
  model alone would have (`observe_lookups`).
  Where that has averaged below 1, rows are looked up only every `_RECHECK_LOOKUPS` steps, which is
  how a job notices when they pay again (its suffix index learning the answers).

A looked-up token is a point mass: its draft probability is one-hot, so modified rejection sampling
accepts it with probability target_probs[token] and, on rejection, samples the recovered token from
the target with that token removed, exactly (decoding/rejection.py); reproducible sampling accepts
it iff it is the target's race winner. Lossless either way, as for a draft model.

All of it runs on the host, on host copies of the rows' tokens fed by the step's one read-back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from specq.decoding.prompt_lookup import RowLookup
from specq.decoding.proposer import Offer
from specq.decoding.stats import DRAFT_MODEL, NGRAM, SUFFIX

if TYPE_CHECKING:
    from specq.decoding.batch import Admission, BatchState
    from specq.decoding.draft_head import DraftHeadProposer
    from specq.decoding.draft_model import DraftModelProposer
    from specq.decoding.k_policy import SpeculationPolicy
    from specq.decoding.stats import EngineStats
    from specq.decoding.suffix_index import SuffixIndex

# Prompt lookup's match lengths. Below 3 tokens a match in code or prose is mostly chance (a one- or
# two-token n-gram recurs everywhere) and its proposals are rejected often enough to cost more verify
# width than they earn; 6 covers the distinctive spans. (Two-token matches taken at their first
# occurrence saved SmolLM2's code-edit answers a fifth of their steps, but on the demo pair's grounded
# workload they were rejected: 0.31 acceptance where longer matches had 0.92, and counted in the same
# acceptance as those, they made the policy rest at 16 rows: docs/benchmark-log/2026-12.md, "Prompt
# lookup against transformers'". They want an acceptance of their own first.)
MIN_MATCH, MAX_MATCH = 3, 6
# Where a hybrid's lookups have not paid for their own time (prompt lookups and suffix-index walks cost
# a compute-bound step of 16 rows a few per cent: benchmarks/step_costs.py), it looks up only every this
# many steps, to notice when they pay again (a job's suffix index learning its answers).
_RECHECK_LOOKUPS = 8
# How many context tokens of a finished row's prompt are fed with its output to the suffix index, so
# that the output's first tokens are indexed after the contexts that led to them.
_OUTPUT_CONTEXT = 8


def point_mass_probs(draft_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """draft_probs of looked-up tokens: [rows, k] -> [rows, k, V], one-hot."""
    return torch.nn.functional.one_hot(draft_token_ids, vocab_size).to(torch.float32)


def needs_draft_probs(batch: BatchState) -> bool:
    """Only modified rejection sampling of sampled rows reads draft_probs."""
    return not (batch.sampling.all_greedy or batch.sampling.reproducible)


class ModelFreeProposer:
    """Implements `Proposer` by looking tokens up: prompt lookup, and the suffix index when given."""

    def __init__(
        self,
        max_k: int,
        vocab_size: int,
        suffix_index: SuffixIndex | None = None,
        min_match: int = MIN_MATCH,
        max_match: int = MAX_MATCH,
        policy: SpeculationPolicy | None = None,
    ) -> None:
        self.max_k = max_k
        self.vocab_size = vocab_size
        self.suffix_index = suffix_index
        self.min_match, self.max_match = min_match, max_match
        self.policy = policy  # weighs a row's suffix-index proposal against its prompt lookup (`_better`)
        self.lookups: list[RowLookup | None] = []  # [rows]
        self.proposals: list[list[int]] = []  # [rows], the last offer's tokens

    @property
    def sources(self) -> tuple[int, ...]:
        """The proposers its offers may come from."""
        return (NGRAM,) if self.suffix_index is None else (NGRAM, SUFFIX)

    def admit(self, batch: BatchState, admission: Admission, stats: EngineStats) -> None:
        for row in admission.rows:
            slot = batch.slots[row]
            assert slot is not None
            prompt = list(slot.request.prompt_token_ids)
            lookup = RowLookup(self.min_match, self.max_match, prompt_len=len(prompt))
            lookup.extend(prompt)
            self.lookups[row] = lookup

    def offer(self, batch: BatchState, live: np.ndarray, limits: np.ndarray) -> Offer:
        lengths = np.zeros(batch.rows, np.int64)
        sources = np.full(batch.rows, NGRAM, np.int64)
        for row in live:
            lookup = self.lookups[row]
            limit = int(min(limits[row], self.max_k))
            if lookup is None or limit <= 0:
                self.proposals[row] = []
                continue
            tokens, _ = lookup.propose(limit)
            if self.suffix_index is not None:
                suffix = self.suffix_index.propose(lookup.tokens, limit)
                if self._better(suffix.tokens, tokens):
                    tokens, sources[row] = suffix.tokens, SUFFIX
            self.proposals[row] = tokens
            lengths[row] = len(tokens)
        return Offer(lengths, sources)

    def _better(self, suffix: list[int], looked_up: list[int]) -> bool:
        """Whether a row takes the suffix index's proposal over its prompt lookup's: the one of more expected
        tokens at its length, by the policy's measured acceptance of each (without a policy: the longer).
        By length alone, the index's proposals from other prompts' answers, longer and mostly rejected
        where answers do not share their text (extract at batch 1: a fifth to a third of their tokens
        accepted), displaced the row's own prompt lookup, which would have been accepted."""
        if self.policy is None or not suffix or not looked_up:
            return len(suffix) > len(looked_up)
        by_suffix = self.policy.expected_tokens_by_length(SUFFIX)[len(suffix)]
        return bool(by_suffix > self.policy.expected_tokens_by_length(NGRAM)[len(looked_up)])

    def propose(
        self, batch: BatchState, k: int, num_draft_h: np.ndarray, stats: EngineStats
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        draft_h = np.zeros((batch.rows, k), np.int64)  # [rows, k]
        for row in np.flatnonzero(num_draft_h):
            tokens = self.proposals[row][: num_draft_h[row]]
            draft_h[row, : len(tokens)] = tokens
        draft_token_ids = torch.from_numpy(draft_h).to(batch.device)  # [rows, k]
        if not needs_draft_probs(batch):
            return draft_token_ids, None
        return draft_token_ids, point_mass_probs(draft_token_ids, self.vocab_size)

    def advance(self, batch: BatchState, output_ids: np.ndarray, emitted: np.ndarray) -> None:
        for row in np.flatnonzero(emitted):
            lookup = self.lookups[row]
            if lookup is not None:
                lookup.extend(output_ids[row, : emitted[row]].tolist())

    def release(self, rows: list[int], rows_t: torch.Tensor) -> None:
        for row in rows:
            lookup = self.lookups[row]
            if lookup is not None and self.suffix_index is not None:
                self.suffix_index.add(lookup.tokens[max(lookup.prompt_len - _OUTPUT_CONTEXT, 0) :])
            self.lookups[row] = None
            self.proposals[row] = []

    def resize(self, rows: int, capacity: int, keep: np.ndarray | None) -> None:
        kept = (list(range(len(self.lookups))) if keep is None else keep.tolist())[:rows]
        add = rows - len(kept)
        self.lookups = [self.lookups[i] for i in kept] + [None] * add
        self.proposals = [self.proposals[i] for i in kept] + [[] for _ in range(add)]


class HybridProposer:
    """Implements `Proposer` with a draft model (or a draft head: decoding/draft_head.py) and a model-free
    proposer, row by row."""

    def __init__(
        self, draft: DraftModelProposer | DraftHeadProposer, model_free: ModelFreeProposer, policy: SpeculationPolicy
    ) -> None:
        self.draft, self.model_free, self.policy = draft, model_free, policy
        self.max_k = model_free.max_k  # K: a looked-up row may verify deeper than the draft model goes
        self._sources = np.zeros(0, np.int64)  # [rows], the last offer's
        self._steps_without_lookups = 0
        self._lookups_taken = False  # whether the plan of the last step that looked up took any lookup

    def admit(self, batch: BatchState, admission: Admission, stats: EngineStats) -> None:
        self.draft.admit(batch, admission, stats)
        self.model_free.admit(batch, admission, stats)

    def offer(self, batch: BatchState, live: np.ndarray, limits: np.ndarray) -> Offer:
        full = self.draft.offer(batch, live, limits).lengths[live]  # [live] as deep as the draft model goes
        nothing = np.zeros_like(full)
        if self._looks_up(batch.rows, full, np.minimum(limits[live], self.max_k)):
            started = time.perf_counter()
            looked_up = self.model_free.offer(batch, live, limits)
            seconds = time.perf_counter() - started
            lookups, lookup_sources = looked_up.lengths[live], looked_up.sources[live]
            mix = self.policy.best_mix(batch.rows, full, lookups, lookup_sources)
            self.policy.observe_lookups(batch.rows, seconds, mix)
            self._steps_without_lookups = 0
            self._lookups_taken = bool(mix.k and mix.takes_lookup.any())
        else:  # the plan the lookups would have led to, without their time
            lookups = lookup_sources = nothing
            mix = self.policy.best_mix(batch.rows, full, lookups, lookup_sources)
            self._steps_without_lookups += 1
        lengths, sources = np.zeros(batch.rows, np.int64), np.full(batch.rows, DRAFT_MODEL, np.int64)
        # where speculation does not pay, whole offers stand, for the step to rest on or probe with
        k, depth = (mix.k, mix.depth) if mix.k else (self.max_k, self.max_k)
        lengths[live] = np.where(mix.takes_lookup, np.minimum(lookups, k), np.minimum(full, depth))
        sources[live] = np.where(mix.takes_lookup, lookup_sources, DRAFT_MODEL)
        self._sources = sources
        return Offer(lengths, sources)

    def _looks_up(self, rows: int, full: np.ndarray, longest: np.ndarray) -> bool:
        """Whether this step looks its rows up (the draft model offering `full` [live] tokens, a lookup at
        most `longest` [live]): where lookups have paid for their time lately or a re-check is due, and a
        lookup could be taken at all. That last check is made only after a step whose plan took no lookup:
        where lookups are taken step after step (one row, on a grounded or templated job) it cost as much
        as the lookups it would have saved (`benchmarks/step_costs.py`, offers ms)."""
        due = self.policy.lookups_pay(rows) or self._steps_without_lookups + 1 >= _RECHECK_LOOKUPS
        return due and (
            self._lookups_taken or self.policy.could_take_a_lookup(rows, full, longest, self.model_free.sources)
        )

    def propose(
        self, batch: BatchState, k: int, num_draft_h: np.ndarray, stats: EngineStats
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        looked_up = (self._sources != DRAFT_MODEL) & (num_draft_h > 0)  # [rows]
        by_draft = (self._sources == DRAFT_MODEL) & (num_draft_h > 0)
        ids, probs = self.model_free.propose(batch, k, num_draft_h * looked_up, stats)
        if not by_draft.any():
            return ids, probs
        # the draft model runs only as deep as its own rows go; looked-up rows may verify further
        depth = int(num_draft_h[by_draft].max())
        draft_ids, draft_probs = self.draft.propose(batch, depth, num_draft_h * by_draft, stats)
        draft_ids = torch.nn.functional.pad(draft_ids, (0, k - depth))  # [rows, k]
        if draft_probs is not None:
            draft_probs = torch.nn.functional.pad(draft_probs, (0, 0, 0, k - depth))  # [rows, k, V]
        rows = np.flatnonzero(looked_up)
        if rows.size == 0:
            return draft_ids, draft_probs
        rows_t = torch.from_numpy(rows).to(batch.device)  # [n]
        self.draft.forget_drafts(rows_t, batch.seq_lens, batch.seq_h, rows)
        draft_ids[rows_t] = ids[rows_t]
        if draft_probs is not None and probs is not None:
            draft_probs[rows_t] = probs[rows_t]
        return draft_ids, draft_probs if needs_draft_probs(batch) else None

    def advance(self, batch: BatchState, output_ids: np.ndarray, emitted: np.ndarray) -> None:
        self.draft.advance(batch, output_ids, emitted)
        self.model_free.advance(batch, output_ids, emitted)

    def release(self, rows: list[int], rows_t: torch.Tensor) -> None:
        self.draft.release(rows, rows_t)
        self.model_free.release(rows, rows_t)

    def resize(self, rows: int, capacity: int, keep: np.ndarray | None) -> None:
        self.draft.resize(rows, capacity, keep)
        self.model_free.resize(rows, capacity, keep)
        kept = (self._sources if keep is None else self._sources[keep])[:rows]
        self._sources = np.concatenate([kept, np.zeros(rows - kept.size, np.int64)])
