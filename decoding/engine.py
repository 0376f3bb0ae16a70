"""Batched speculative decoding with continuous batching (Leviathan et al. 2023, Algorithm 1; Chen et
al. 2023), read top to bottom as gpt-fast's `generate.py` is, one batch of rows at a time.

One step, for every sequence (row) of the batch at once:

    propose   the proposer (decoding/proposer.py; a draft model: decoding/draft_model.py) offers up to
              k draft tokens per row, with the draft probabilities they were drawn from;
    verify    the target scores the last token and the k draft tokens of every row in ONE forward
              pass: k + 1 distributions per row;
    accept    modified rejection sampling per row (decoding/rejection.py): a row's *output* is its
              *accepted* draft tokens plus one *recovered* token (sampled from the residual at the
              first rejection) or *bonus* token (all k accepted); at temperature 0, the target's own
              greedy tokens; with reproducible sampling, the target's race winners, the draft
              tokens being accepted while they are those winners (decoding/sampling.py);
    advance   each row gains its own number of tokens; the target cache and the proposer roll back per
              row (decoding/kv_cache.py), so no row waits for the slowest one;
    finish    the host reads the step's few numbers once and ends rows on EOS, max_tokens or a stop
              string (decoding/stopping.py); their results are yielded and their rows freed. A row
              whose output came from target logits that were not finite (NaN or inf: broken weights)
              fails alone, with the token it happened at; a draft's such distributions are rejected
              (decoding/rejection.py), so they cost speed, never correctness.

k is chosen per step by `SpeculationPolicy` (decoding/k_policy.py) from the rows' offers and measured
step times (decoding/draft_plan.py; k = 0 is plain decoding, the only mode without a proposer; while the
policy rests, the step asks the proposer for nothing). Requests take free rows once checked
(decoding/intake.py); the target's prefill of them emits each one's first token itself
(decoding/prefill.py), so no step is spent on it. Rows end on different steps: free rows are refilled
several to a prefill (rows of similar length in one forward, decoding/prefill_groups.py) and, once no
request waits, dropped, each when the steps they idle through cost more (decoding/idle_rows.py).

Invariants at the start of a step, per row: the sequence (prompt and generated tokens) is
`token_ids[:seq_len]`; the target cache holds its first `seq_len - 1` tokens (the last one is the
first input of the next verification).

The device is read once per step (`BatchState.append`): one small tensor with each row's accepted
count, first position of non-finite target logits and output tokens, which the host needs for endings,
stop strings, failures and refills. Nothing in propose, verify, accept or advance syncs.
Log-probabilities, where asked for, are decoding/logprobs.py's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sized
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch

from specq.decoding.batch import Appended, BatchState
from specq.decoding.config import DecodingConfig
from specq.decoding.draft_head import DraftHead, DraftHeadProposer
from specq.decoding.draft_model import DraftModelProposer
from specq.decoding.draft_plan import plan_drafts
from specq.decoding.hf_model import CausalLM, RaggedLM, Tokenizer, eos_token_ids, start_token_id
from specq.decoding.idle_rows import IdleRows
from specq.decoding.intake import RequestIntake
from specq.decoding.k_policy import SpeculationPolicy
from specq.decoding.kv_cache import RaggedKVCache
from specq.decoding.model_free import HybridProposer, ModelFreeProposer
from specq.decoding.prefill import TargetPrefill
from specq.decoding.proposer import Proposer
from specq.decoding.rejection import greedy_accept, rejection_sample
from specq.decoding.sampling import (
    Stream,
    check_probs,
    counter_uniforms,
    first_nonfinite,
    logits_to_probs,
    race_sample,
    sample_from_probs,
)
from specq.decoding.static_shapes import is_cuda_graphed, lease_cache
from specq.decoding.stats import EngineStats
from specq.decoding.stopping import FINISHED_STOP, ended_rows, endings
from specq.decoding.stopwatch import Stopwatch
from specq.decoding.suffix_index import SuffixIndex
from specq.decoding.types import GenerationRequest, GenerationResult


@dataclass
class _StepReport:
    """What the host learns from one step, [rows] each."""

    appended: Appended  # each row's output ids, accepted and emitted (appended) tokens
    kept: np.ndarray  # tokens that stay in the completion (up to EOS or max_tokens)
    finish: np.ndarray  # decoding.stopping's RUNNING, FINISHED_STOP (EOS) or FINISHED_LENGTH
    drafted: np.ndarray  # draft tokens offered


class SpeculativeEngine:
    """Decodes batches of requests with a target model and, optionally, a draft model.

    `generate` pulls requests lazily (memory stays flat however many there are) and yields one
    `GenerationResult` per request as it finishes (completion order; match them by `key`).
    """

    def __init__(
        self,
        target: CausalLM,
        tokenizer: Tokenizer,
        draft: CausalLM | DraftHead | None = None,
        config: DecodingConfig | None = None,
        policy: SpeculationPolicy | None = None,
        suffix_index: SuffixIndex | None = None,
    ) -> None:
        """`policy`: pass the one a previous engine on the same models and device used, so its measured
        step times and acceptance carry over (a worker builds an engine per batch). `suffix_index`: the
        job's (with `config.model_free == "suffix"`), fed by this engine's prompts and outputs and read
        by its proposals; None: a fresh one for this engine. `draft`: a draft model, or a draft head on the
        target's hidden states (decoding/draft_head.py)."""
        self.config = config or DecodingConfig()
        if self.config.num_speculative_tokens == 0:
            draft = None  # K = 0 proposes nothing: plain decoding with the target, whatever proposers were given
        head = draft if isinstance(draft, DraftHead) else None
        draft_model = None if isinstance(draft, DraftHead) else draft
        self.target, self.draft, self.tokenizer = target, draft_model, tokenizer
        # a forward replaying CUDA graphs needs the shapes they were recorded with (decoding/static_shapes.py)
        self.static_shapes = self.config.static_shapes or any(
            is_cuda_graphed(model) for model in (target, draft_model) if model is not None
        )
        # a compiled model (decoding/compiled.py) compiles lazily what its load did not: such a step is not timed
        self._compiled = any(hasattr(model, "_orig_mod") for model in (target, draft_model) if model is not None)
        self.target_lm = RaggedLM(target, static=self.static_shapes)
        self.device = self.target_lm.device
        draft_lm = None if draft_model is None else RaggedLM(draft_model, static=self.static_shapes)
        if draft_lm is not None and draft_lm.device != self.device:
            raise ValueError("target and draft must be on the same device")
        model_free = self.config.model_free if self.config.num_speculative_tokens else None
        speculates = draft_lm is not None or model_free is not None or head is not None
        self.max_k = self.config.num_speculative_tokens if speculates else 0
        lms = [lm for lm in (self.target_lm, draft_lm) if lm is not None]
        self.vocab_size = max(lm.vocab_size for lm in lms)
        self.max_context = min(lm.max_context for lm in lms)
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        self._eos_h = np.array(sorted(self.eos_token_ids) or [-1])
        self.intake = RequestIntake(self.max_context, self.target_lm.vocab_size, start_token_id(tokenizer))
        self.prefill = TargetPrefill(self.target_lm, self.vocab_size)
        if policy is not None and (policy.max_k, policy.fixed) != (self.max_k, self.config.fixed_k):
            raise ValueError("the policy was made for another K or mode")
        self.policy = policy or SpeculationPolicy(
            self.max_k, fixed=self.config.fixed_k, probe_interval=self.config.probe_interval
        )
        if model_free == "suffix" and suffix_index is None:
            suffix_index = SuffixIndex()
        self.suffix_index = suffix_index if model_free == "suffix" else None
        self.proposer = self._proposer(draft_lm, head, model_free)
        self.stats = EngineStats.for_k(self.max_k)
        self.idle_rows = IdleRows(self.config.batch_size, self.device)
        self._draining = False  # no request waits for a row: the batch ends with its slowest row
        # the models a refill prefills: the target, and a draft model at its next proposal
        self._prefilling = [lm for lm in (self.target_lm, draft_lm) if lm is not None]

    def _proposer(self, draft_lm: RaggedLM | None, head: DraftHead | None, model_free: str | None) -> Proposer | None:
        depth = self.config.draft_model_depth
        self._draft_proposer = (
            None
            if draft_lm is None
            else DraftModelProposer(draft_lm, depth, self.vocab_size, self.target_lm.vocab_size)
        )
        draft: DraftModelProposer | DraftHeadProposer | None = self._draft_proposer
        if head is not None:
            draft = DraftHeadProposer(head, self.target, depth, self.vocab_size)
            self.target_lm.hidden_tap = draft.tap  # a row's first state: its prefill's last hidden state
        if model_free is None:
            return draft
        looked_up = ModelFreeProposer(self.max_k, self.vocab_size, self.suffix_index, policy=self.policy)
        return looked_up if draft is None else HybridProposer(draft, looked_up, self.policy)

    def reset_stats(self) -> None:
        self.stats = EngineStats.for_k(self.max_k)

    # -- the request loop ---------------------------------------------------------------------------
    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[GenerationResult]:
        started = time.perf_counter()
        waiting = iter(requests)
        exhausted = self._draining = False
        # how many requests there are, where that is known without reading ahead (a list): a batch that no
        # request will refill then drains from its first step on; a stream is known to have run out only
        # at a refill that finds none (reading ahead would hand the caller's next request over early)
        count = len(requests) if isinstance(requests, Sized) else None
        taken = 0
        try:
            with torch.inference_mode(), ExitStack() as caches:
                batch = BatchState(
                    self._target_cache(caches),
                    self.device,
                    self.proposer,
                    self.config.sampling == "reproducible",
                    static_rows=self.config.batch_size if self.static_shapes else None,
                )
                while True:
                    if not exhausted and self._refill_due(batch):
                        self.idle_rows.refilled()
                        free = self.config.batch_size - batch.num_live()
                        admitted, failures, exhausted = self.intake.take(waiting, free)
                        taken += len(admitted) + len(failures)
                        exhausted = self._draining = exhausted or taken == count
                        yield from failures
                        if admitted:
                            yield from self._admit(batch, admitted)
                    if batch.num_live() == 0:
                        if exhausted:
                            return
                        continue
                    yield from self._step(batch)
                    if exhausted and batch.compactable() and self.idle_rows.compaction_due():
                        with self.idle_rows.compacting():
                            batch.compact()
        finally:
            self.stats.time_total_s += time.perf_counter() - started

    def _refill_due(self, batch: BatchState) -> bool:
        """Whether to refill the batch's free rows now (decoding/idle_rows.py): several to a prefill, since
        rows ending on different steps (per-row acceptance) refilled one or two at a time would each pay
        a forward's fixed cost."""
        if batch.num_live() == self.config.batch_size:  # every step of a full batch: ask nothing more
            return False
        live = batch.live_rows()
        tokens_left = np.minimum(
            batch.max_tokens_h[live] - batch.generated_h[live], self.max_context - batch.seq_h[live]
        )
        overhead_s = sum(lm.prefill_cost.overhead_seconds() for lm in self._prefilling)
        return self.idle_rows.refill_due(tokens_left, overhead_s)

    def _target_cache(self, caches: ExitStack) -> RaggedKVCache:
        """The target's cache for one `generate`; with static shapes, the caches kept for the models, held
        until it returns (the draft model's given to its proposer)."""
        if not self.static_shapes:
            return self.target_lm.new_cache(0, 0)
        if self._draft_proposer is not None:
            lm = self._draft_proposer.lm
            self._draft_proposer.cache = caches.enter_context(lease_cache(lm.model, lm.num_layers))
        return caches.enter_context(lease_cache(self.target_lm.model, self.target_lm.num_layers))

    # -- admission ----------------------------------------------------------------------------------
    def _admit(self, batch: BatchState, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Put requests into rows and prefill for them; returns the results of requests that ended on their
        first token (emitted at prefill)."""
        admission = batch.admit(requests, self.tokenizer, extra_columns=self.max_k + 1)
        prompts = [r.prompt_token_ids for r in requests]
        first_logits = self.prefill(batch, admission, prompts, proposer=self.proposer, stats=self.stats)
        return [] if first_logits is None else self._emit_first(batch, admission.rows, first_logits)

    def _emit_first(self, batch: BatchState, rows: np.ndarray, first_logits: torch.Tensor) -> list[GenerationResult]:
        """Append each new row's first token, from the prefill's last logits [n, V]: feeding the last
        prompt token again in a step of its own would cost a forward."""
        rows_t = torch.as_tensor(rows, device=self.device)  # [n]
        logits = first_logits.new_zeros(batch.rows, 1, first_logits.shape[-1])  # [rows, 1, V]
        logits[rows_t, 0] = first_logits
        output_token_ids, _ = self._accept(batch, logits)  # [rows, 1]
        emitting = torch.zeros_like(batch.active)  # [rows]
        emitting[rows_t] = 1
        batch.record_logprobs(logits, output_token_ids, vocab_size=self.target_lm.vocab_size)
        no_drafts = np.zeros(batch.rows, np.int64)  # [rows]
        report = self._advance(
            batch, rows, output_token_ids, logits, mask=emitting, num_accepted=None, num_draft_h=no_drafts
        )
        return list(self._finish(batch, rows, report))

    # -- one step: propose, verify, accept, advance, finish -----------------------------------------
    def _step(self, batch: BatchState) -> Iterator[GenerationResult]:
        # from the offers on: a model-free proposer's lookups are part of a step
        watch = Stopwatch(self.device, compiled=self._compiled)
        live = batch.live_rows()
        batch.held_prompts.forget_idle(live)
        plan = plan_drafts(batch, live, self.proposer, self.policy, self.max_context, draining=self._draining)
        k, num_draft_h = plan.k, plan.num_draft
        # uploaded before any work of the step is queued, so the copy waits for nothing
        num_draft = torch.from_numpy(num_draft_h).to(self.device) if k else None  # [rows]
        watch.mark()
        prefilled_s = self.stats.time_prefill_s
        draft_token_ids, draft_probs = self._propose(batch, k, num_draft_h)
        watch.mark()
        # a draft model's prefill of rows new since its last proposal is prefill, not this step's drafting
        prefilled_s = self.stats.time_prefill_s - prefilled_s
        target_logits = self._verify(batch, draft_token_ids)
        watch.mark()
        output_token_ids, num_accepted = self._accept(
            batch, target_logits, draft_token_ids=draft_token_ids, draft_probs=draft_probs, num_draft=num_draft
        )
        batch.record_logprobs(target_logits, output_token_ids, vocab_size=self.target_lm.vocab_size)
        report = self._advance(
            batch,
            live,
            output_token_ids,
            target_logits,
            mask=batch.active,
            num_accepted=num_accepted,
            num_draft_h=num_draft_h,
        )
        if k:  # part of the step's time: the policy weighs what speculating costs on the host too
            self._count_drafts(batch, live, report, plan.sources)
        watch.mark()
        t_offer, t_draft, t_target, t_rest = watch.seconds()
        t_draft = max(t_draft - prefilled_s, 0.0)
        t_step = t_offer + t_draft + t_target + t_rest
        if self.max_k and not watch.compiled_a_graph():  # a compile's seconds are no step's cost
            offers_s = t_offer if plan.offered else None
            self.policy.observe_step(
                batch.rows, k, t_draft, t_target, t_step, t_offer=offers_s, draft_forwards=plan.draft_forwards
            )
        self.stats.observe_step(batch.rows, k, t_draft=t_draft, t_target=t_target, t_step=t_step)
        self.idle_rows.stepped(t_step, live.size, batch.rows)
        yield from self._finish(batch, live, report)

    def _propose(
        self, batch: BatchState, k: int, num_draft_h: np.ndarray
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """draft_token_ids [rows, k] and draft_probs [rows, k, V] (None when not read); (None, None) for k = 0."""
        if not k:
            return None, None
        assert self.proposer is not None  # k > 0 needs max_k > 0, which needs a proposer
        return self.proposer.propose(batch, k, num_draft_h, self.stats)

    def _verify(self, batch: BatchState, draft_token_ids: torch.Tensor | None) -> torch.Tensor:
        """Target logits for the last token and every draft token: [rows, k + 1, V], one forward pass."""
        last_column = (batch.seq_lens - 1).unsqueeze(1)  # [rows, 1]
        last = batch.token_ids.gather(1, last_column)  # [rows, 1]
        inputs = last if draft_token_ids is None else torch.cat([last, draft_token_ids], dim=1)  # [rows, k + 1]
        width = inputs.shape[1]
        columns = last_column + batch.arange(width)  # [rows, k + 1]
        kv_length = int(batch.seq_h.max()) - 1 + width
        self.stats.target_forwards += 1
        return self.target_lm.step(batch.target_cache, inputs, columns, kv_length, self.vocab_size)

    def _accept(
        self,
        batch: BatchState,
        target_logits: torch.Tensor,
        *,
        draft_token_ids: torch.Tensor | None = None,
        draft_probs: torch.Tensor | None = None,
        num_draft: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Output token ids [rows, k + 1] (row b's output is its first num_accepted[b] + 1) and num_accepted
        [rows] (None without draft tokens: every row then emits one token)."""
        sampling = batch.sampling
        if sampling.all_greedy:
            target_argmax = target_logits.argmax(dim=-1)  # [rows, k + 1]
            if draft_token_ids is None:
                return target_argmax, None
            assert num_draft is not None
            return greedy_accept(draft_token_ids, target_argmax, num_draft)
        width = target_logits.shape[1]
        positions = batch.seq_lens.unsqueeze(1) + batch.arange(width)  # [rows, k + 1]
        target_probs = logits_to_probs(target_logits, sampling)  # [rows, k + 1, V]
        if self.config.strict:
            check_probs(target_probs)
        if sampling.reproducible:
            # every output token is the target's race winner at its position; a draft token is accepted
            # iff it is that winner (the draft raced with the same noise), as greedy acceptance does
            target_winners = race_sample(target_probs, sampling.seeds, positions)  # [rows, k + 1]
            if draft_token_ids is None:
                return target_winners, None
            assert num_draft is not None
            return greedy_accept(draft_token_ids, target_winners, num_draft)
        target_uniforms = counter_uniforms(sampling.seeds, positions, Stream.TARGET)  # [rows, k + 1]
        if draft_token_ids is None:
            return sample_from_probs(target_probs, target_uniforms), None
        assert draft_probs is not None and num_draft is not None
        if self.config.strict:
            check_probs(draft_probs)
        accept_uniforms = counter_uniforms(sampling.seeds, positions[:, :-1], Stream.ACCEPT)  # [rows, k]
        return rejection_sample(draft_token_ids, draft_probs, target_probs, accept_uniforms, target_uniforms, num_draft)

    def _advance(
        self,
        batch: BatchState,
        rows: np.ndarray,
        output_token_ids: torch.Tensor,
        target_logits: torch.Tensor,
        *,
        mask: torch.Tensor,
        num_accepted: torch.Tensor | None,
        num_draft_h: np.ndarray,
    ) -> _StepReport:
        """Append the output of `rows` (`mask`: the same rows, a [rows] 0/1 mask on the device), roll the
        target cache (`BatchState.append`) and the proposer back per row, and find rows that ended. The
        output came from `target_logits` [rows, k + 1, V], whose first non-finite position per row is
        read with it (a row ending on it fails in `_finish`)."""
        if self.config.strict:
            assert int((batch.seq_lens + output_token_ids.shape[1]).max()) <= batch.capacity
        room = batch.max_tokens_h - (batch.seq_h - batch.prompt_h)  # [rows] tokens each row may still add
        nonfinite_at = first_nonfinite(target_logits)  # [rows]
        appended = batch.append(
            output_token_ids, num_accepted=num_accepted, nonfinite_at=nonfinite_at, rows=rows, mask=mask
        )
        kept, finish = endings(appended.output_ids, appended.emitted, room, self._eos_h)
        if self.proposer is not None:
            self.proposer.advance(batch, appended.output_ids, appended.emitted)
        return _StepReport(appended=appended, kept=kept, finish=finish, drafted=num_draft_h)

    def _count_drafts(self, batch: BatchState, live: np.ndarray, report: _StepReport, sources: np.ndarray) -> None:
        """Book a speculative step's draft tokens and acceptance for rows `live`, by proposer (`sources`
        [rows]), with the rows, the policy and the stats."""
        accepted, drafted, live_sources = report.appended.accepted[live], report.drafted[live], sources[live]
        batch.count_drafts(live, drafted, accepted)
        self.policy.observe_acceptance(accepted, drafted, live_sources)
        self.stats.observe_drafts(live_sources, drafted, accepted)

    def _finish(self, batch: BatchState, live: np.ndarray, report: _StepReport) -> Iterator[GenerationResult]:
        """Book the step's tokens for rows `live`; yield the results of those that ended, and fail those
        whose target logits were not finite."""
        broken = _nonfinite_rows(live, report)
        if broken.size:
            yield from self._fail_nonfinite(batch, broken, report)
            live = np.setdiff1d(live, broken)
            report.kept[broken] = 0
        now = time.perf_counter()
        batch.keep(live, report.kept, now)  # finished rows keep 0
        output_ids = report.appended.output_ids
        ended = ended_rows(live, report.kept, report.finish, output_ids, watching=batch.has_stops_h, slots=batch.slots)
        if ended:
            results = batch.finish(ended, now, self.tokenizer)
            self.stats.num_generated_tokens += sum(result.completion_tokens for result in results)
            yield from results

    def _fail_nonfinite(self, batch: BatchState, broken: np.ndarray, report: _StepReport) -> list[GenerationResult]:
        """Fail rows `broken`, whose target logits were not finite (broken or overflowing weights): their
        tokens would be an argmax or a sample of NaN, a completion the target never chose."""
        # the completion's token (1-based) the first bad logits were to decide
        at = batch.generated_h[broken] + report.appended.nonfinite_at[broken] + 1
        errors = {
            int(row): f"the target model produced non-finite logits (NaN or inf) at token {n} of the completion"
            for row, n in zip(broken, at, strict=True)
        }
        return batch.fail(errors)


def _nonfinite_rows(live: np.ndarray, report: _StepReport) -> np.ndarray:
    """The rows of `live` whose output this step used target logits that were not finite: those deciding
    the kept tokens, and the EOS a row ended on; logits past where a row ends decide nothing."""
    decided = report.kept + (report.finish == FINISHED_STOP)  # [rows]
    return live[report.appended.nonfinite_at[live] < decided[live]]
