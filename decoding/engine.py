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
              string (decoding/stopping.py); their results are yielded and their rows freed.

k is chosen per step by `SpeculationPolicy` (decoding/k_policy.py) from measured step times (k = 0 is
plain decoding, the only mode without a proposer; while the policy rests, the step asks the proposer
for nothing). The prefill reads the whole prompt and emits the first token itself, so no step is spent
on it: with short completions (labels, 20-token answers) that step would be a large share of the work.
Free rows are refilled from the waiting requests, several to a prefill (rows of similar length in
one forward, decoding/prefill_groups.py): rows end on different steps, and refilling each at once
would pay a forward's fixed cost per row or two, so free rows wait while the steps they idle through
cost less; once no request waits, free rows are dropped (decoding/batch.py) once they cost as much as
dropping them (both: decoding/idle_rows.py).

Invariants at the start of a step, per row: the sequence (prompt and generated tokens) is
`token_ids[:seq_len]`; the target cache holds its first `seq_len - 1` tokens (the last one is the
first input of the next verification).

The device is read once per step: one small tensor with each row's accepted count and output
tokens, which the host needs for endings, stop strings and refills. Nothing in propose, verify,
accept or advance syncs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch

from specq.decoding.batch import Admission, BatchState
from specq.decoding.config import DecodingConfig
from specq.decoding.draft_model import DraftModelProposer
from specq.decoding.hf_model import CausalLM, RaggedLM, Tokenizer, decode, eos_token_ids, start_token_id
from specq.decoding.idle_rows import IdleRows
from specq.decoding.k_policy import SpeculationPolicy
from specq.decoding.kv_cache import RaggedKVCache
from specq.decoding.model_free import HybridProposer, ModelFreeProposer
from specq.decoding.proposer import Proposer
from specq.decoding.rejection import greedy_accept, rejection_sample
from specq.decoding.sampling import Stream, counter_uniforms, logits_to_probs, race_sample, sample_from_probs
from specq.decoding.static_shapes import is_cuda_graphed, lease_cache
from specq.decoding.stats import DRAFT_MODEL, EngineStats
from specq.decoding.suffix_index import SuffixIndex
from specq.decoding.types import GenerationRequest, GenerationResult, TokenLogprob

RUNNING, FINISHED_STOP, FINISHED_LENGTH = 0, 1, 2


@dataclass
class _StepReport:
    """What the host learns from one step, [rows] each (output_ids [rows, k + 1])."""

    kept: np.ndarray  # tokens that stay in the completion (up to EOS or max_tokens)
    finish: np.ndarray  # RUNNING, FINISHED_STOP (EOS) or FINISHED_LENGTH
    accepted: np.ndarray  # draft tokens accepted
    drafted: np.ndarray  # draft tokens offered
    emitted: np.ndarray  # tokens appended to the row's sequence (accepted + 1), EOS and past it included
    output_ids: np.ndarray  # the step's accepted tokens and recovered or bonus token, then padding


class _Stopwatch:
    """Phase times without a host sync: CUDA events on a GPU, wall clock on a CPU (already synchronous)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.events: list[torch.cuda.Event] = []
        self.times: list[float] = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        else:
            self.times.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Durations between consecutive marks; call after the step's sync."""
        if self.cuda:
            self.events[-1].synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.events, self.events[1:], strict=False)]
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


class SpeculativeEngine:
    """Decodes batches of requests with a target model and, optionally, a draft model.

    `generate` pulls requests lazily (memory stays flat however many there are) and yields one
    `GenerationResult` per request as it finishes (completion order; match them by `key`).
    """

    def __init__(
        self,
        target: CausalLM,
        tokenizer: Tokenizer,
        draft: CausalLM | None = None,
        config: DecodingConfig | None = None,
        policy: SpeculationPolicy | None = None,
        suffix_index: SuffixIndex | None = None,
    ) -> None:
        """`policy`: pass the one a previous engine on the same models and device used, so its measured
        step times and acceptance carry over (a worker builds an engine per batch). `suffix_index`: the
        job's (with `config.model_free == "suffix"`), fed by this engine's prompts and outputs and read
        by its proposals; None: a fresh one for this engine."""
        self.config = config or DecodingConfig()
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        # a forward replaying CUDA graphs needs the shapes they were recorded with (decoding/static_shapes.py)
        self.static_shapes = self.config.static_shapes or any(
            is_cuda_graphed(model) for model in (target, draft) if model is not None
        )
        self.target_lm = RaggedLM(target, static=self.static_shapes)
        self.device = self.target_lm.device
        draft_lm = None if draft is None else RaggedLM(draft, static=self.static_shapes)
        if draft_lm is not None and draft_lm.device != self.device:
            raise ValueError("target and draft must be on the same device")
        model_free = self.config.model_free
        speculates = draft_lm is not None or model_free is not None
        self.max_k = self.config.num_speculative_tokens if speculates else 0
        lms = [lm for lm in (self.target_lm, draft_lm) if lm is not None]
        self.vocab_size = max(lm.vocab_size for lm in lms)
        self.max_context = min(lm.max_context for lm in lms)
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        self._eos_h = np.array(sorted(self.eos_token_ids) or [-1])
        self._start_token_id = start_token_id(tokenizer)
        if policy is not None and (policy.max_k, policy.fixed) != (self.max_k, self.config.fixed_k):
            raise ValueError("the policy was made for another K or mode")
        self.policy = policy or SpeculationPolicy(
            self.max_k, fixed=self.config.fixed_k, probe_interval=self.config.probe_interval
        )
        if model_free == "suffix" and suffix_index is None:
            suffix_index = SuffixIndex()
        self.suffix_index = suffix_index if model_free == "suffix" else None
        self.proposer = self._proposer(draft_lm, model_free)
        self.stats = EngineStats(accepted_per_position=[0] * self.max_k)
        self._emit_at_prefill = self.target_lm.keeps_logits
        self.idle_rows = IdleRows(self.config.batch_size, self.device)
        # the models a refill prefills: the target, and a draft model at its next proposal
        self._prefilling = [lm for lm in (self.target_lm, draft_lm) if lm is not None]

    def _proposer(self, draft_lm: RaggedLM | None, model_free: str | None) -> Proposer | None:
        draft = (
            None
            if draft_lm is None
            else DraftModelProposer(draft_lm, self.config.draft_model_depth, self.vocab_size, self.target_lm.vocab_size)
        )
        self._draft_proposer = draft
        if model_free is None:
            return draft
        looked_up = ModelFreeProposer(self.max_k, self.vocab_size, self.suffix_index)
        return looked_up if draft is None else HybridProposer(draft, looked_up, self.policy)

    def reset_stats(self) -> None:
        self.stats = EngineStats(accepted_per_position=[0] * self.max_k)

    # -- the request loop ---------------------------------------------------------------------------
    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[GenerationResult]:
        started = time.perf_counter()
        waiting = iter(requests)
        exhausted = False
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
                        admitted, failures, exhausted = self._take(waiting, batch)
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

    def _take(
        self, waiting: Iterator[GenerationRequest], batch: BatchState
    ) -> tuple[list[GenerationRequest], list[GenerationResult], bool]:
        """Up to the batch's free rows of valid requests, the failures of invalid ones, and whether the
        requests ran out."""
        free = self.config.batch_size - batch.num_live()
        admitted: list[GenerationRequest] = []
        failures: list[GenerationResult] = []
        while len(admitted) < free:
            request = next(waiting, None)
            if request is None:
                return admitted, failures, True
            request = self._with_start_token(request)
            problem = self._problem(request)
            if problem:
                failures.append(GenerationResult.failed(request.key, problem, len(request.prompt_token_ids)))
            else:
                admitted.append(request)
        return admitted, failures, False

    def _with_start_token(self, request: GenerationRequest) -> GenerationRequest:
        if request.prompt_token_ids or self._start_token_id is None:
            return request
        return GenerationRequest(request.key, (self._start_token_id,), request.params)

    def _problem(self, request: GenerationRequest) -> str | None:
        prompt_len, max_tokens = len(request.prompt_token_ids), request.params.max_tokens
        if prompt_len == 0:
            return "empty prompt, and the tokenizer has no BOS or EOS token to start from"
        if prompt_len + max_tokens > self.max_context:
            return (
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                f"context of {self.max_context} tokens"
            )
        # the target reads every prompt id; the draft reads the ids it cannot take as another
        readable = self.target_lm.vocab_size
        if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= readable:
            return f"prompt has token ids outside the vocabulary [0, {readable})"
        return None

    # -- admission ----------------------------------------------------------------------------------
    def _admit(self, batch: BatchState, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Put requests into rows and prefill for them; returns the results of requests that ended on their
        first token (emitted at prefill)."""
        admission = batch.admit(requests, self.tokenizer, extra_columns=self.max_k + 1)
        first_logits = self._prefill(batch, admission, [r.prompt_token_ids for r in requests])
        if first_logits is None:
            return []
        return self._emit_first(batch, admission.rows, first_logits)

    def _prefill(self, batch: BatchState, admission: Admission, prompts: list[tuple[int, ...]]) -> torch.Tensor | None:
        """Run the target over each whole prompt and return its logits at each prompt's last token [n, V],
        for the first output token; then the proposer takes the new rows (a draft model reads their
        prompts at its first proposal for them). A model that cannot return chosen positions' logits
        alone reads all but the last token instead (None returned), and the first step verifies that
        token with the first draft tokens.

        Rows with the same prompt (a line's `n` choices) share the target's prefill: it runs once for
        the first of them, whose cache columns the others copy."""
        started = time.perf_counter()
        shared = _shared_prompts(prompts)
        full = admission
        if shared is not None:
            admission = _select(admission, shared.leaders)
        n = len(admission.rows)
        first_logits = None
        if self._emit_at_prefill:
            leaders = [tuple(prompts[i]) for i in (range(n) if shared is None else shared.leaders)]
            prompt_ids, starts = self._unshared_tails(batch, admission, leaders)  # [n, width]
            lengths = admission.prompt_lens - (0 if starts is None else starts)  # [n]
            first_logits, forwards = self.target_lm.prefill_rows(
                batch.target_cache, admission.rows, prompt_ids, lengths, self.vocab_size, starts, last_logits=True
            )  # [n, V]
            self.stats.target_forwards += forwards
            self.stats.prefill_tokens += int(lengths.sum())
        else:
            lengths = admission.prompt_lens - 1  # [n] the last prompt token is verified by the first step
            reading = np.flatnonzero(lengths > 0)
            if reading.size:
                _, forwards = self.target_lm.prefill_rows(
                    batch.target_cache,
                    admission.rows[reading],
                    admission.prompt_ids[torch.from_numpy(reading).to(self.device)],
                    lengths[reading],
                    self.vocab_size,
                )
                self.stats.target_forwards += forwards
            self.stats.prefill_tokens += int(lengths.sum())
        if self.proposer is not None:
            self.proposer.admit(batch, full, self.stats)
        if shared is not None:
            followers = np.flatnonzero(shared.leaders[shared.inverse] != np.arange(len(full.rows)))  # [f]
            source = torch.from_numpy(full.rows[shared.leaders[shared.inverse[followers]]]).to(self.device)
            batch.target_cache.copy_rows(
                source, full.rows_t[torch.from_numpy(followers).to(self.device)], full.prompt_ids.shape[1]
            )
            if first_logits is not None:
                first_logits = first_logits[torch.from_numpy(shared.inverse).to(self.device)]  # [n, V]
        if self._emit_at_prefill:  # every prompt column written (without, the last one is written by a step)
            batch.held_prompts.record(full.rows.tolist(), [tuple(prompt) for prompt in prompts])
        self.stats.time_prefill_s += time.perf_counter() - started
        return first_logits

    def _unshared_tails(
        self, batch: BatchState, admission: Admission, prompts: list[tuple[int, ...]]
    ) -> tuple[torch.Tensor, np.ndarray | None]:
        """What the prefill of `admission`'s rows (prompts `prompts`) must run: the prompts' ids [n, width]
        and None, or, where rows hold a long head of them (decoding/prefix_reuse.py), the ids after it,
        right-padded, and where each row's starts [n], its head copied into it first."""
        heads = batch.held_prompts.lend(batch.target_cache, admission.rows, admission.rows_t, prompts)
        if not heads.any():
            return admission.prompt_ids, None
        tails = [prompt[head:] for prompt, head in zip(prompts, heads.tolist(), strict=True)]
        width = max(map(len, tails))
        padded = [list(tail) + [0] * (width - len(tail)) for tail in tails]
        self.stats.prompt_tokens_reused += int(heads.sum())
        return torch.tensor(padded, device=self.device), heads

    def _emit_first(self, batch: BatchState, rows: np.ndarray, first_logits: torch.Tensor) -> list[GenerationResult]:
        """Append each new row's first token, from the prefill's last logits [n, V]: feeding the last
        prompt token again in a step of its own would cost a forward."""
        rows_t = torch.as_tensor(rows, device=self.device)  # [n]
        logits = first_logits.new_zeros(batch.rows, 1, first_logits.shape[-1])  # [rows, 1, V]
        logits[rows_t, 0] = first_logits
        output_token_ids, _ = self._accept(batch, None, None, logits, None)  # [rows, 1]
        emitting = torch.zeros_like(batch.active)  # [rows]
        emitting[rows_t] = 1
        self._record_logprobs(batch, logits, output_token_ids)
        report = self._advance(batch, rows, emitting, output_token_ids, None, np.zeros(batch.rows, np.int64))
        return list(self._finish(batch, rows, report))

    # -- one step: propose, verify, accept, advance, finish -----------------------------------------
    def _step(self, batch: BatchState) -> Iterator[GenerationResult]:
        watch = _Stopwatch(self.device)  # from the offers on: a model-free proposer's lookups are part of a step
        live = batch.live_rows()
        batch.held_prompts.forget_idle(live)
        offered = self.proposer is not None and self.policy.wants_offers(batch.rows)
        k, num_draft_h, sources_h = self._choose_k(batch, live) if offered else self._plain(batch)
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
        output_token_ids, num_accepted = self._accept(batch, draft_token_ids, draft_probs, target_logits, num_draft)
        self._record_logprobs(batch, target_logits, output_token_ids)
        report = self._advance(batch, live, batch.active, output_token_ids, num_accepted, num_draft_h)
        if k:  # part of the step's time: the policy weighs what speculating costs on the host too
            self._count_drafts(batch, live, report, sources_h)
        watch.mark()
        t_offer, t_draft, t_target, t_rest = watch.seconds()
        t_draft = max(t_draft - prefilled_s, 0.0)
        t_step = t_offer + t_draft + t_target + t_rest
        if self.max_k:
            # the draft model runs as many forwards as its deepest row takes (decoding/model_free.py)
            forwards = int(num_draft_h[sources_h == DRAFT_MODEL].max(initial=0))
            offers_s = t_offer if offered else None
            self.policy.observe_step(
                batch.rows, k, t_draft, t_target, t_step, t_offer=offers_s, draft_forwards=forwards
            )
        self._record(batch.rows, k, t_draft, t_target, t_step)
        self.stats.num_steps += 1
        self.idle_rows.stepped(t_step, live.size, batch.rows)
        yield from self._finish(batch, live, report)

    def _plain(self, batch: BatchState) -> tuple[int, np.ndarray, np.ndarray]:
        """A step without speculation: no proposer, or a resting policy (k_policy.py), which is told."""
        if self.proposer is not None:
            self.policy.rest()
        none = np.zeros(batch.rows, np.int64)  # [rows]
        return 0, none, none.copy()

    def _choose_k(self, batch: BatchState, live: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
        """This step's k, the draft tokens each row may accept ([rows], 0 for rows not live or without a
        proposal) and the proposer each row's draft comes from ([rows])."""
        # A row takes at most one draft token fewer than it still wants, and none past the context.
        row_limits = np.minimum(batch.max_tokens_h - batch.generated_h - 1, self.max_context - batch.seq_h)
        num_draft_h = np.zeros(batch.rows, np.int64)  # [rows]
        assert self.proposer is not None
        offer = self.proposer.offer(batch, live, np.maximum(row_limits, 0))
        offers = offer.lengths[live]  # [live]
        top = int(offers.max())
        # no row has anything to offer (no match anywhere): a plain step, and no time measured for the policy
        k = self.policy.choose(batch.rows, top, offers, offer.sources[live]) if top > 0 else 0
        if k:
            num_draft_h[live] = np.minimum(offers, k)
            k = int(num_draft_h.max())
        return k, num_draft_h, offer.sources

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
        draft_token_ids: torch.Tensor | None,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        num_draft: torch.Tensor | None,
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
            _check_probs(target_probs)
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
            _check_probs(draft_probs)
        accept_uniforms = counter_uniforms(sampling.seeds, positions[:, :-1], Stream.ACCEPT)  # [rows, k]
        return rejection_sample(draft_token_ids, draft_probs, target_probs, accept_uniforms, target_uniforms, num_draft)

    def _advance(
        self,
        batch: BatchState,
        live: np.ndarray,
        active: torch.Tensor,
        output_token_ids: torch.Tensor,
        num_accepted: torch.Tensor | None,
        num_draft_h: np.ndarray,
    ) -> _StepReport:
        """Append the output of rows `live` (`active`: the same rows, a [rows] 0/1 mask on the device),
        roll the target cache and the proposer back per row, and find rows that ended.

        The device only appends and moves lengths; where a row ends (EOS, max_tokens) is worked out
        on the host copy of the step's few numbers, where small array operations cost far less.
        """
        width = output_token_ids.shape[1]
        emitted = active if num_accepted is None else (num_accepted + 1) * active  # [rows]
        if self.config.strict:
            assert int((batch.seq_lens + width).max()) <= batch.capacity
        batch.token_ids.scatter_(1, batch.seq_lens.unsqueeze(1) + batch.arange(width), output_token_ids)
        # The target cache now holds seq_len_old + k tokens and should hold seq_len_new - 1: that is the
        # per-row rollback, implied by seq_lens.
        batch.seq_lens = batch.seq_lens + emitted
        report = self._read_back(batch, live, output_token_ids, num_accepted, num_draft_h)
        if self.proposer is not None:
            self.proposer.advance(batch, report.output_ids, report.emitted)
        return report

    def _read_back(
        self,
        batch: BatchState,
        live: np.ndarray,
        output_token_ids: torch.Tensor,
        num_accepted: torch.Tensor | None,
        num_draft_h: np.ndarray,
    ) -> _StepReport:
        """The step's one host sync: [rows, k + 1] output ids (and [rows] accepted counts); then each row's
        kept tokens and ending, and the host mirror of seq_lens."""
        width = output_token_ids.shape[1]
        if num_accepted is None:
            output_h, accepted_h = output_token_ids.cpu().numpy(), np.zeros(batch.rows, np.int64)
        else:
            host = torch.cat([num_accepted.unsqueeze(1), output_token_ids], dim=1).cpu().numpy()  # [rows, k + 2]
            output_h, accepted_h = host[:, 1:], host[:, 0]
        active_h = np.zeros(batch.rows, np.int64)  # [rows]
        active_h[live] = 1
        accepted_h = accepted_h * active_h
        emitted_h = (accepted_h + 1) * active_h  # [rows]
        room = batch.max_tokens_h - (batch.seq_h - batch.prompt_h)  # [rows] tokens each row may still add
        is_eos = output_h == self._eos_h[0]  # [rows, k + 1]; one comparison per EOS id (np.isin: ~100 us)
        for eos in self._eos_h[1:]:
            is_eos |= output_h == eos
        is_eos &= np.arange(width) < emitted_h[:, None]
        first_eos = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1), width)  # [rows], width: none
        ends_on_eos = first_eos < np.minimum(emitted_h, room)
        kept = np.where(ends_on_eos, first_eos, np.minimum(emitted_h, room)) * active_h
        finish = np.where(ends_on_eos, FINISHED_STOP, np.where(kept >= room, FINISHED_LENGTH, RUNNING)) * active_h
        batch.seq_h = batch.seq_h + emitted_h
        return _StepReport(
            kept=kept, finish=finish, accepted=accepted_h, drafted=num_draft_h, emitted=emitted_h, output_ids=output_h
        )

    def _record_logprobs(self, batch: BatchState, target_logits: torch.Tensor, output_token_ids: torch.Tensor) -> None:
        """For rows that asked: the target's raw log-probabilities (log_softmax of the logits the step
        verified with, [rows, k + 1, V]: before temperature, top-k and top-p) of each output token and of
        the likeliest alternatives, written on the device at the columns the tokens go to; read once, when
        the row ends (`_token_logprobs`). Tokens past what a row keeps are overwritten later or never read.
        No host sync (the rows come from the host mirror); rows that did not ask cost nothing."""
        buffers = batch.logprob_buffers
        asking = np.flatnonzero(batch.logprobs_h >= 0)
        if buffers is None or asking.size == 0:
            return
        rows_t = torch.from_numpy(asking).to(self.device)  # [n]
        width = output_token_ids.shape[1]
        vocab = self.target_lm.vocab_size  # past it: padding for a larger draft vocabulary
        logprobs = target_logits.index_select(0, rows_t)[..., :vocab].float().log_softmax(dim=-1)  # [n, k + 1, V]
        outputs = output_token_ids.index_select(0, rows_t)  # [n, k + 1]
        chosen = logprobs.gather(-1, outputs.unsqueeze(-1)).squeeze(-1)  # [n, k + 1]
        columns = batch.seq_lens.index_select(0, rows_t).unsqueeze(1) + batch.arange(width)  # [n, k + 1]
        row_index = rows_t.unsqueeze(1).expand(-1, width)  # [n, k + 1]
        buffers.chosen[row_index, columns] = chosen
        if buffers.top:
            top_values, top_ids = logprobs.topk(buffers.top, dim=-1)  # [n, k + 1, top]
            buffers.top_values[row_index, columns] = top_values
            buffers.top_ids[row_index, columns] = top_ids

    def _token_logprobs(self, batch: BatchState, row: int, start: int, tokens: list[int]) -> list[TokenLogprob]:
        """A finished row's `tokens` (from column `start`) with their recorded log-probabilities: two reads,
        the values (the token's own first) and the alternatives' ids."""
        buffers = batch.logprob_buffers
        assert buffers is not None
        wanted, end = int(batch.logprobs_h[row]), start + len(tokens)
        values = torch.cat(
            [buffers.chosen[row, start:end, None], buffers.top_values[row, start:end, :wanted]], dim=1
        ).tolist()  # [n, 1 + wanted]
        top_ids = buffers.top_ids[row, start:end, :wanted].tolist()  # [n, wanted]
        chosen = [v[0] for v in values]
        top_values = [v[1:] for v in values]
        return [
            TokenLogprob(
                token_id,
                self._token_text(token_id),
                logprob,
                tuple((i, self._token_text(i), v) for i, v in zip(ids, values, strict=True)),
            )
            for token_id, logprob, ids, values in zip(tokens, chosen, top_ids, top_values, strict=True)
        ]

    def _token_text(self, token_id: int) -> str:
        return decode(self.tokenizer, [token_id])

    def _count_drafts(self, batch: BatchState, live: np.ndarray, report: _StepReport, sources: np.ndarray) -> None:
        """Book a speculative step's draft tokens and acceptance for rows `live`, by proposer (`sources`
        [rows]), with the policy and the stats."""
        accepted, drafted, live_sources = report.accepted[live], report.drafted[live], sources[live]
        batch.draft_tokens_h[live] += drafted
        batch.accepted_h[live] += accepted
        self.policy.observe_acceptance(accepted, drafted, live_sources)
        self.stats.count_drafts(live_sources, drafted, accepted)
        self.stats.num_drafts += int((drafted > 0).sum())
        self.stats.num_draft_tokens += int(drafted.sum())
        self.stats.num_accepted_tokens += int(accepted.sum())
        # accepted_per_position[i] counts the rows that accepted more than i tokens
        at_least = np.bincount(accepted, minlength=self.max_k + 1)[::-1].cumsum()[::-1]  # [K + 1]
        for i, count in enumerate(at_least[1 : self.max_k + 1].tolist()):
            self.stats.accepted_per_position[i] += count

    def _finish(self, batch: BatchState, live: np.ndarray, report: _StepReport) -> Iterator[GenerationResult]:
        """Book the step's tokens for rows `live`; yield the results of those that ended."""
        kept, finish = report.kept, report.finish
        batch.generated_h += kept  # finished rows keep 0
        now = time.perf_counter()
        for row in live[(batch.generated_h[live] == kept[live]) & (kept[live] > 0)]:  # their first tokens
            first = batch.slots[row]
            assert first is not None
            first.first_token_at = now
        finished: dict[int, tuple[str, list[int] | None, str | None]] = {}  # reason, tokens, text
        # Only rows that ended or watch for stop strings need the host; the rest stay vectorised.
        for row in live[(finish[live] != RUNNING) | batch.has_stops_h[live]]:
            slot = batch.slots[row]
            assert slot is not None
            if slot.stops is not None:
                cut = slot.stops.feed(report.output_ids[row, : kept[row]].tolist())
                if cut is not None:
                    finished[int(row)] = ("stop", cut, slot.stops.cut_text)
                    continue
            if finish[row] != RUNNING:
                finished[int(row)] = ("stop" if finish[row] == FINISHED_STOP else "length", None, None)
        if not finished:
            return
        rows = sorted(finished)
        sequences = batch.token_ids[torch.tensor(rows, device=self.device)].cpu().numpy()  # [ended, capacity]
        for row, sequence in zip(rows, sequences, strict=True):
            slot = batch.slots[row]
            assert slot is not None
            reason, tokens, text = finished[row]
            start = int(batch.prompt_h[row])
            if tokens is None:
                tokens = sequence[start : start + batch.generated_h[row]].tolist()
            wants_logprobs = batch.logprobs_h[row] >= 0
            self.stats.num_generated_tokens += len(tokens)
            yield GenerationResult(
                key=slot.request.key,
                token_ids=tokens,
                text=decode(self.tokenizer, tokens) if text is None else text,
                finish_reason=reason,  # type: ignore[arg-type]
                prompt_tokens=int(batch.prompt_h[row]),
                completion_tokens=len(tokens),
                draft_tokens=int(batch.draft_tokens_h[row]),
                accepted_tokens=int(batch.accepted_h[row]),
                seed=slot.seed,
                latency_s=now - slot.started,
                first_token_s=None if slot.first_token_at is None else slot.first_token_at - slot.started,
                # a stop string cuts the tokens, and so their log-probabilities
                logprobs=self._token_logprobs(batch, row, start, tokens) if wants_logprobs else None,
            )
        batch.release(rows)

    def _record(self, rows: int, k: int, t_draft: float, t_target: float, t_step: float) -> None:
        stats = self.stats
        stats.time_draft_s += t_draft
        stats.time_target_s += t_target
        stats.k_steps[k] = stats.k_steps.get(k, 0) + 1
        if k:
            stats.add_time(f"draft@{rows}", t_draft, count=k)
        stats.add_time(f"target:{k + 1}@{rows}", t_target)
        stats.add_time(f"step:{k}@{rows}", t_step)


@dataclass(frozen=True)
class _SharedPrompts:
    """Admitted rows grouped by prompt: the first row of each prompt (its leader) and each row's group."""

    leaders: np.ndarray  # [u] positions in the admission of each distinct prompt's first row
    inverse: np.ndarray  # [n] each row's index into `leaders`


def _shared_prompts(prompts: list[tuple[int, ...]]) -> _SharedPrompts | None:
    """The rows that share a prompt with an earlier row, or None when every prompt is distinct."""
    group_of: dict[tuple[int, ...], int] = {}
    leaders: list[int] = []
    inverse = []
    for position, prompt in enumerate(prompts):
        group = group_of.get(prompt)
        if group is None:
            group = group_of[prompt] = len(leaders)
            leaders.append(position)
        inverse.append(group)
    if len(leaders) == len(prompts):
        return None
    return _SharedPrompts(np.array(leaders, np.int64), np.array(inverse, np.int64))


def _select(admission: Admission, positions: np.ndarray) -> Admission:
    """The admission of the rows at `positions` alone."""
    index = torch.from_numpy(positions).to(admission.rows_t.device)
    return Admission(
        rows=admission.rows[positions],
        rows_t=admission.rows_t[index],
        prompt_ids=admission.prompt_ids[index],
        prompt_lens=admission.prompt_lens[positions],
    )


def _check_probs(probs: torch.Tensor) -> None:
    total = probs.sum(-1)
    assert torch.allclose(total, torch.ones_like(total), atol=1e-4), "probabilities do not sum to 1"
    assert bool((probs >= 0).all()), "negative probability"
