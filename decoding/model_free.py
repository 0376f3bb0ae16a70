"""Model-free proposers: prompt lookup alone, with the job's suffix index, or beside a draft model.

- `ModelFreeProposer`: per row, the tokens that followed the longest earlier match of the row's
  suffix in its own sequence (decoding/prompt_lookup.py; Saxena 2023, vLLM's `ngram`) and, with a
  `SuffixIndex`, the most frequent continuation in the job's finished outputs (decoding/suffix_index.py;
  SuffixDecoding, Oliaro et al. 2025), whichever is longer. A row without a match offers nothing and
  costs only its verified token.
  The index is fed outputs, each after the last few tokens of its prompt, not whole prompts: a row's
  own prompt is prompt lookup's to copy from, as SuffixDecoding keeps a per-request tree for it, and
  the job's other prompts, where they share a template, repeat what the row's own prompt holds. Fed
  every prompt too, the index cost a compute-bound batch time where it was never used, and the suffix
  contender was slower on every workload and batch size measured (docs/benchmarks.md, "The draft axis").
- `HybridProposer`: a draft model and a model-free proposer within ONE verify pass. Each step weighs
  two plans by the policy's expected tokens per second (decoding/k_policy.py), which prices the draft
  model's forwards and the verify width: (a) rows with a match take it where its measured acceptance
  says it yields at least as many tokens as the draft model would, the other rows the draft model's
  proposal; (b) looked-up proposals alone, with no draft forward at all (rows without a match verify
  only their one token). So a long confident match is not slowed by the draft forwards that the rest
  of the batch would need only where those forwards earn less than they cost. Rows are looked up only
  on steps where a lookup as long as the row may take could be taken by either plan, and the draft
  model's rows go no deeper than it would go alone, so a wide verify that looked-up rows take costs
  it no more forwards.

A looked-up token is a point mass: its draft probability is one-hot, so modified rejection sampling
accepts it with probability target_probs[token] and, on rejection, samples the recovered token from
the target with that token removed, exactly (decoding/rejection.py); reproducible sampling accepts
it iff it is the target's race winner. Lossless either way, as for a draft model.

All of it runs on the host, on host copies of the rows' tokens fed by the step's one read-back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specq.decoding.prompt_lookup import RowLookup
from specq.decoding.proposer import Offer
from specq.decoding.stats import DRAFT_MODEL, NGRAM, SUFFIX

if TYPE_CHECKING:
    from specq.decoding.batch import Admission, BatchState
    from specq.decoding.draft_model import DraftModelProposer
    from specq.decoding.k_policy import SpeculationPolicy
    from specq.decoding.stats import EngineStats
    from specq.decoding.suffix_index import SuffixIndex

# Prompt lookup's match lengths. Below 3 tokens a match in code or prose is mostly chance (a one- or
# two-token n-gram recurs everywhere) and its proposals are rejected often enough to cost more verify
# width than they earn; 6 covers the distinctive spans.
MIN_MATCH, MAX_MATCH = 3, 6
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
    ) -> None:
        self.max_k = max_k
        self.vocab_size = vocab_size
        self.suffix_index = suffix_index
        self.min_match, self.max_match = min_match, max_match
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
                if len(suffix.tokens) > len(tokens):
                    tokens, sources[row] = suffix.tokens, SUFFIX
            self.proposals[row] = tokens
            lengths[row] = len(tokens)
        return Offer(lengths, sources)

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
    """Implements `Proposer` with a draft model and a model-free proposer, row by row."""

    def __init__(self, draft: DraftModelProposer, model_free: ModelFreeProposer, policy: SpeculationPolicy) -> None:
        self.draft, self.model_free, self.policy = draft, model_free, policy
        self.max_k = draft.max_k
        self._sources = np.zeros(0, np.int64)  # [rows], the last offer's

    def admit(self, batch: BatchState, admission: Admission, stats: EngineStats) -> None:
        self.draft.admit(batch, admission, stats)
        self.model_free.admit(batch, admission, stats)

    def offer(self, batch: BatchState, live: np.ndarray, limits: np.ndarray) -> Offer:
        full = self.draft.offer(batch, live, limits)  # as long as each row may take
        drafted, with_draft = self._draft_model_offers(batch, live, full)
        looking = live if self._a_lookup_could_be_taken(batch, live, full, drafted, with_draft) else live[:0]
        looked_up = self.model_free.offer(batch, looking, limits)
        lengths, sources = drafted.lengths.copy(), drafted.sources.copy()
        rows = live[looked_up.lengths[live] > 0]
        # expected tokens a row gains from either proposal: what each proposer's measured acceptance says
        by_draft = self.policy.expected_tokens_by_length(DRAFT_MODEL)[lengths[rows]]  # [n]
        by_lookup = np.zeros(rows.size)
        for source in np.unique(looked_up.sources[rows]):
            mine = looked_up.sources[rows] == source
            by_lookup[mine] = self.policy.expected_tokens_by_length(int(source))[looked_up.lengths[rows[mine]]]
        takes_lookup = rows[by_lookup >= by_draft]
        lengths[takes_lookup], sources[takes_lookup] = looked_up.lengths[takes_lookup], looked_up.sources[takes_lookup]
        mixed = Offer(lengths, sources)
        if (sources[live] == DRAFT_MODEL).any() and self._looked_up_alone_pays(batch, live, mixed, looked_up):
            mixed = looked_up
        self._sources = mixed.sources
        return mixed

    def _draft_model_offers(self, batch: BatchState, live: np.ndarray, full: Offer) -> tuple[Offer, float]:
        """The draft model's offers no deeper than it would go alone, and that plan's rate (0 while not
        measured): a wider verify that looked-up rows take then costs the draft model no more forwards.
        Where it would not speculate alone, its offers stand, for the step's choice to weigh with the
        looked-up ones."""
        lengths = full.lengths[live]  # [live]
        top = int(lengths.max(initial=0))
        k_draft, with_draft = self.policy.best(batch.rows, top, lengths, full.sources[live]) if top else (0, 0.0)
        drafted = Offer(full.lengths.copy(), full.sources)
        if k_draft > 0:
            drafted.lengths[live] = np.minimum(lengths, k_draft)
        return drafted, with_draft

    def _a_lookup_could_be_taken(
        self, batch: BatchState, live: np.ndarray, full: Offer, drafted: Offer, with_draft: float
    ) -> bool:
        """Whether either plan below could take a looked-up proposal this step, judged before any lookup
        from the best a lookup could be: as long as the row may take (`full`), at the acceptance of the
        looked-up proposer that expects the most. Where it could not, the rows are not looked up and
        the plan is the one the lookups would have led to: the draft model for every row, without the
        lookups' time. `drafted`: the draft model's offers, `with_draft`: its best rate alone."""
        lengths = full.lengths[live]  # [live]
        if not lengths.any():
            return False
        by_draft = self.policy.expected_tokens_by_length(DRAFT_MODEL)  # [K + 1]
        candidates = self.model_free.sources
        by_lookup = np.max([self.policy.expected_tokens_by_length(source) for source in candidates], axis=0)
        if (by_lookup[lengths] >= by_draft[drafted.lengths[live]]).any():
            return True
        top = int(lengths.max())
        return with_draft > 0 and self.policy.best_rate_of_any(batch.rows, top, lengths, candidates) > with_draft

    def _looked_up_alone_pays(self, batch: BatchState, live: np.ndarray, mixed: Offer, looked_up: Offer) -> bool:
        """Whether looked-up proposals alone (no draft forward) promise more tokens per second than the
        mix with the draft model; False while either plan's cost is not yet measured."""
        top = int(max(mixed.lengths[live].max(), looked_up.lengths[live].max()))
        if top == 0 or not looked_up.lengths[live].any():
            return False
        _, with_draft = self.policy.best(batch.rows, top, mixed.lengths[live], mixed.sources[live])
        _, without = self.policy.best(batch.rows, top, looked_up.lengths[live], looked_up.sources[live])
        return with_draft > 0 and without > with_draft

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
