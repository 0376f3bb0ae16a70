"""Batched speculative decoding with continuous batching (Leviathan et al. 2023; Chen et al. 2023).

One step, for every sequence (row) of the batch at once:

    propose   the draft proposes k tokens (k forward passes of the draft, one token each, after
              a first pass that catches the draft up on tokens it has not seen yet);
    verify    the target scores the last token and the k draft tokens of every row in ONE forward
              pass: k + 1 distributions per row;
    accept    modified rejection sampling per row (decoding/rejection.py): the accepted prefix plus
              one recovered or bonus token; at temperature 0, the target's own greedy tokens;
    advance   each row gains its own number of tokens and both KV caches are rolled back per row
              (decoding/kv_cache.py), so no row waits for the slowest one.

k is chosen per step by `SpeculationPolicy` from measured step times (k = 0 is plain decoding,
the only mode without a draft; there the prefill reads the whole prompt and emits the first token
itself, where with a draft the last prompt token is verified together with the first draft tokens).
Rows end on their own (EOS, a stop string, max_tokens); their slots are refilled from the waiting
requests, and once none are left the batch is compacted so finished rows stop costing compute.

Invariants at the start of a step, per row: the sequence (prompt and generated tokens) is
`token_ids[:seq_len]`; the target cache holds its first `seq_len - 1` tokens (the last one is the
first input of the next verification); the draft cache holds its first `draft_len <= seq_len - 1`.

The device is read once per step: one small tensor with each row's emitted count, finish code and
tokens, which the host needs for stop strings and refills. Nothing in propose/verify/accept syncs.
"""

from __future__ import annotations

import inspect
import secrets
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from specq.decoding.config import DecodingConfig
from specq.decoding.k_policy import SpeculationPolicy
from specq.decoding.kv_cache import RaggedKVCache
from specq.decoding.rejection import greedy_accept, rejection_sample
from specq.decoding.sampling import SamplingTensors, Stream, counter_uniforms, logits_to_probs, sample_from_probs
from specq.decoding.stats import EngineStats
from specq.decoding.stopping import StopChecker
from specq.decoding.types import GenerationRequest, GenerationResult

RUNNING, FINISHED_STOP, FINISHED_LENGTH = 0, 1, 2
_LAST = 1  # logits_to_keep: the last position only (a prefill whose logits nobody reads)
_CAPACITY_QUANTUM = 64  # cache columns are allocated in multiples of this, to grow rarely


@dataclass
class _Slot:
    """Host-side state of one live request."""

    request: GenerationRequest
    seed: int
    started: float
    stops: StopChecker | None


@dataclass
class _Batch:
    """The rows being decoded. Device tensors drive the models; host arrays mirror what sizes need."""

    token_ids: torch.Tensor  # [rows, capacity] int64: each row's sequence, left-aligned
    seq_lens: torch.Tensor  # [rows] int64
    draft_lens: torch.Tensor  # [rows] int64
    prompt_lens: torch.Tensor  # [rows] int64
    max_tokens: torch.Tensor  # [rows] int64
    active: torch.Tensor  # [rows] int64 1, or 0 for a finished row that waits to be reused or dropped
    target_cache: RaggedKVCache
    draft_cache: RaggedKVCache | None
    sampling: SamplingTensors
    slots: list[_Slot | None]
    # host mirrors, [rows] int64
    seq_h: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    draft_h: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prompt_h: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    max_tokens_h: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    generated_h: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    draft_tokens_h: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    accepted_h: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    has_stops_h: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def capacity(self) -> int:
        return self.token_ids.shape[1]

    def live_rows(self) -> np.ndarray:
        return np.array([i for i, slot in enumerate(self.slots) if slot is not None], dtype=np.int64)


@dataclass
class _StepReport:
    """What the host learns from one step, [rows] each (output_ids [rows, k + 1])."""

    kept: np.ndarray  # tokens that stay in the completion (up to EOS or max_tokens)
    finish: np.ndarray  # RUNNING, FINISHED_STOP (EOS) or FINISHED_LENGTH
    accepted: np.ndarray  # draft tokens accepted
    drafted: np.ndarray  # draft tokens offered
    output_ids: np.ndarray  # the step's accepted tokens and recovered or bonus token, then padding


class _Stopwatch:
    """Phase times without a host sync: CUDA events on a GPU, wall clock on a CPU (already synchronous)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Durations between consecutive marks; call after the step's sync."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


class SpeculativeEngine:
    """Decodes batches of requests with a target model and, optionally, a draft model.

    `generate` pulls requests lazily (memory stays flat however many there are) and yields one
    `GenerationResult` per request as it finishes (completion order; match them by `key`).
    """

    def __init__(
        self,
        target,
        tokenizer,
        draft=None,
        config: DecodingConfig | None = None,
        policy: SpeculationPolicy | None = None,
    ) -> None:
        """`policy`: pass the one a previous engine on the same models and device used, so its measured
        step times and acceptance carry over (a worker builds an engine per batch)."""
        self.config = config or DecodingConfig()
        self.target, self.draft, self.tokenizer = target, draft, tokenizer
        self.device = next(target.parameters()).device
        if draft is not None and next(draft.parameters()).device != self.device:
            raise ValueError("target and draft must be on the same device")
        self.max_k = self.config.num_speculative_tokens if draft is not None else 0
        self.vocab_size = max(_vocab_size(m) for m in (target, draft) if m is not None)
        self.max_context = min(_max_context(m) for m in (target, draft) if m is not None)
        self.eos_token_ids = _eos_token_ids(target, tokenizer)
        self._eos_h = np.array(sorted(self.eos_token_ids) or [-1])
        self._aranges = torch.arange(1024, device=self.device)
        self._start_token_id = _start_token_id(tokenizer)
        if policy is not None and (policy.max_k, policy.fixed) != (self.max_k, self.config.fixed_k):
            raise ValueError("the policy was made for another K or mode")
        self.policy = policy or SpeculationPolicy(
            self.max_k, fixed=self.config.fixed_k, probe_interval=self.config.probe_interval
        )
        self.stats = EngineStats(accepted_per_position=[0] * self.max_k)
        self._emit_at_prefill = draft is None and _accepts(target, "logits_to_keep")

    def reset_stats(self) -> None:
        self.stats = EngineStats(accepted_per_position=[0] * self.max_k)

    # -- the request loop ---------------------------------------------------------------------------
    def generate(self, requests: Iterable[GenerationRequest]) -> Iterator[GenerationResult]:
        started = time.perf_counter()
        waiting = iter(requests)
        batch: _Batch | None = None
        exhausted = False
        try:
            with torch.inference_mode():
                while True:
                    if not exhausted and (
                        batch is None or any(s is None for s in batch.slots) or batch.rows < self.config.batch_size
                    ):
                        admitted, failures, exhausted = self._take(waiting, batch)
                        yield from failures
                        if admitted:
                            batch, ended = self._admit(batch, admitted)
                            yield from ended
                    if batch is None or batch.live_rows().size == 0:
                        if exhausted:
                            return
                        continue
                    yield from self._step(batch)
                    if exhausted:
                        batch = self._compact(batch)
        finally:
            self.stats.time_total_s += time.perf_counter() - started

    def _take(self, waiting: Iterator[GenerationRequest], batch: _Batch | None):
        free = self.config.batch_size - (0 if batch is None else sum(s is not None for s in batch.slots))
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
        if min(request.prompt_token_ids) < 0 or max(request.prompt_token_ids) >= self.vocab_size:
            return f"prompt has token ids outside the vocabulary [0, {self.vocab_size})"
        return None

    # -- admission, compaction ----------------------------------------------------------------------
    def _admit(self, batch: _Batch | None, requests: list[GenerationRequest]) -> tuple[_Batch, list[GenerationResult]]:
        """Put requests into free rows (or new ones) and prefill both caches for them; also the results
        of requests that ended on their first token (target-only decoding emits it at prefill)."""
        need = max(len(r.prompt_token_ids) + r.params.max_tokens for r in requests) + self.max_k + 1
        if batch is None:
            batch = self._empty_batch(rows=len(requests), capacity=need)
            rows = list(range(len(requests)))
        else:
            rows = [i for i, slot in enumerate(batch.slots) if slot is None][: len(requests)]
            extra = len(requests) - len(rows)
            rows += list(range(batch.rows, batch.rows + extra))
            self._resize(batch, batch.rows + extra, max(batch.capacity, need))
        now = time.perf_counter()
        for row, request in zip(rows, requests, strict=True):
            seed = request.params.seed if request.params.seed is not None else secrets.randbits(63)
            stops = StopChecker(self.tokenizer, request.params.stop) if request.params.stop else None
            batch.slots[row] = _Slot(request, seed, now, stops)
            batch.has_stops_h[row] = stops is not None
        first_logits = self._prefill(batch, rows, requests)
        self._refresh_sampling(batch)
        if first_logits is None:
            return batch, []
        return batch, self._emit_first(batch, np.array(rows), first_logits)

    def _emit_first(self, batch: _Batch, rows: np.ndarray, first_logits: torch.Tensor) -> list[GenerationResult]:
        """Append each new row's first token, from the prefill's last logits [n, V]: with no draft to verify
        alongside it, feeding the last prompt token again in a step of its own would cost a forward."""
        rows_t = torch.as_tensor(rows, device=self.device)
        logits = first_logits.new_zeros(batch.rows, 1, first_logits.shape[-1])  # [rows, 1, V]
        logits[rows_t, 0] = first_logits
        output_token_ids, _ = self._accept(batch, None, None, logits, None)  # [rows, 1]
        emitting = torch.zeros_like(batch.active)
        emitting[rows_t] = 1
        report = self._advance(batch, rows, emitting, output_token_ids, None, np.zeros(batch.rows, np.int64))
        return list(self._finish(batch, rows, 0, report))

    def _empty_batch(self, rows: int, capacity: int) -> _Batch:
        capacity = -(-capacity // _CAPACITY_QUANTUM) * _CAPACITY_QUANTUM
        zeros = torch.zeros(rows, dtype=torch.int64, device=self.device)
        return _Batch(
            token_ids=torch.zeros(rows, capacity, dtype=torch.int64, device=self.device),
            seq_lens=zeros.clone() + 1,
            draft_lens=zeros.clone(),
            prompt_lens=zeros.clone(),
            max_tokens=zeros.clone() + 1,
            active=zeros.clone(),
            target_cache=RaggedKVCache(_num_layers(self.target), rows, capacity),
            draft_cache=None if self.draft is None else RaggedKVCache(_num_layers(self.draft), rows, capacity),
            sampling=SamplingTensors.build([0.0] * rows, [1.0] * rows, [0] * rows, [0] * rows, self.device),
            slots=[None] * rows,
            seq_h=np.ones(rows, np.int64),
            draft_h=np.zeros(rows, np.int64),
            prompt_h=np.zeros(rows, np.int64),
            max_tokens_h=np.ones(rows, np.int64),
            generated_h=np.zeros(rows, np.int64),
            draft_tokens_h=np.zeros(rows, np.int64),
            accepted_h=np.zeros(rows, np.int64),
            has_stops_h=np.zeros(rows, bool),
        )

    def _resize(self, batch: _Batch, rows: int, capacity: int, keep: np.ndarray | None = None) -> None:
        """Keep rows `keep` (default: all) first, then add empty rows up to `rows`; grow to `capacity`."""
        capacity = -(-capacity // _CAPACITY_QUANTUM) * _CAPACITY_QUANTUM
        if keep is None and rows == batch.rows and capacity == batch.capacity:
            return
        keep_t = None if keep is None else torch.as_tensor(keep, device=self.device)
        kept = batch.rows if keep is None else len(keep)
        add = rows - kept

        def rowwise(t: torch.Tensor, fill: int | bool) -> torch.Tensor:
            t = t if keep_t is None else t.index_select(0, keep_t)
            return torch.cat([t, torch.full((add, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)])

        token_ids = batch.token_ids if keep_t is None else batch.token_ids.index_select(0, keep_t)
        batch.token_ids = torch.zeros(rows, capacity, dtype=torch.int64, device=self.device)
        width = min(token_ids.shape[1], capacity)
        batch.token_ids[:kept, :width] = token_ids[:, :width]
        batch.seq_lens, batch.draft_lens = rowwise(batch.seq_lens, 1), rowwise(batch.draft_lens, 0)
        batch.prompt_lens, batch.max_tokens = rowwise(batch.prompt_lens, 0), rowwise(batch.max_tokens, 1)
        batch.active = rowwise(batch.active, 0)
        for cache in (batch.target_cache, batch.draft_cache):
            if cache is not None:
                cache.resize(rows, capacity, keep_t)

        def host(a: np.ndarray, fill: int) -> np.ndarray:
            a = a if keep is None else a[keep]
            return np.concatenate([a, np.full(add, fill, np.int64)])

        batch.seq_h, batch.draft_h, batch.prompt_h = (
            host(batch.seq_h, 1),
            host(batch.draft_h, 0),
            host(batch.prompt_h, 0),
        )
        batch.max_tokens_h, batch.generated_h = host(batch.max_tokens_h, 1), host(batch.generated_h, 0)
        batch.draft_tokens_h, batch.accepted_h = host(batch.draft_tokens_h, 0), host(batch.accepted_h, 0)
        batch.has_stops_h = host(batch.has_stops_h, 0).astype(bool)
        slots = batch.slots if keep is None else [batch.slots[i] for i in keep]
        batch.slots = slots + [None] * add
        self._refresh_sampling(batch)

    def _compact(self, batch: _Batch) -> _Batch:
        """Once no request waits, drop finished rows when they are at least half the batch."""
        live = batch.live_rows()
        if live.size and live.size * 2 <= batch.rows:
            self._resize(batch, rows=live.size, capacity=batch.capacity, keep=live)
        return batch

    def _refresh_sampling(self, batch: _Batch) -> None:
        params = [slot.request.params if slot else None for slot in batch.slots]
        batch.sampling = SamplingTensors.build(
            [p.temperature if p else 0.0 for p in params],
            [p.top_p if p else 1.0 for p in params],
            [p.top_k if p else 0 for p in params],
            [slot.seed if slot else 0 for slot in batch.slots],
            self.device,
        )

    def _prefill(self, batch: _Batch, rows: list[int], requests: list[GenerationRequest]) -> torch.Tensor | None:
        """Write the prompts into `rows` and run both models over all but each prompt's last token, which
        the first step verifies with the first draft tokens. With no draft (and a model that can return
        chosen positions' logits) the target reads the whole prompt instead, and its logits at each
        prompt's last token [n, V] are returned for the first output token."""
        started = time.perf_counter()
        prompts = [list(r.prompt_token_ids) for r in requests]
        width = max(len(p) for p in prompts)
        padded = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)  # [n, width]
        rows_t = torch.tensor(rows, device=self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        batch.token_ids[rows_t, :width] = padded
        batch.seq_lens[rows_t] = lengths
        batch.prompt_lens[rows_t] = lengths
        batch.max_tokens[rows_t] = torch.tensor([r.params.max_tokens for r in requests], device=self.device)
        batch.active[rows_t] = 1
        rows_np = np.array(rows)
        batch.seq_h[rows_np] = batch.prompt_h[rows_np] = [len(p) for p in prompts]
        batch.max_tokens_h[rows_np] = [r.params.max_tokens for r in requests]
        batch.generated_h[rows_np] = batch.draft_tokens_h[rows_np] = batch.accepted_h[rows_np] = 0
        batch.draft_h[rows_np] = batch.seq_h[rows_np] - 1
        batch.draft_lens[rows_t] = lengths - 1
        first_logits = None
        if self._emit_at_prefill:
            batch.target_cache.plan_prefill(rows_t, width)
            # positions worked out on the host, from the prompts' lengths: no device sync at admission
            last = np.array([len(p) - 1 for p in prompts])  # [n]
            keep = np.unique(last)  # [u] sorted: the positions whose logits are computed
            logits = self._run(
                self.target,
                batch.target_cache,
                padded,
                self._arange(width).expand_as(padded),
                keep=torch.from_numpy(keep).to(self.device),
            )  # [n, u, V]
            picked = torch.from_numpy(np.searchsorted(keep, last)).to(self.device)  # [n]
            first_logits = logits[self._arange(len(rows)), picked]
            self.stats.prefill_tokens += int(last.sum()) + len(rows)
        elif width > 1:
            inputs = padded[:, : width - 1]  # [n, width - 1]
            for model, cache in ((self.target, batch.target_cache), (self.draft, batch.draft_cache)):
                if model is not None and cache is not None:
                    cache.plan_prefill(rows_t, width - 1)
                    self._run(model, cache, inputs, self._arange(width - 1).expand_as(inputs), keep=_LAST)
            self.stats.prefill_tokens += sum(len(p) - 1 for p in prompts)
        self.stats.time_prefill_s += time.perf_counter() - started
        return first_logits

    # -- one step -----------------------------------------------------------------------------------
    def _step(self, batch: _Batch) -> Iterator[GenerationResult]:
        live = batch.live_rows()
        # A row takes at most one draft token fewer than it still wants, and none past the context.
        row_limits = np.minimum(batch.max_tokens_h - batch.generated_h - 1, self.max_context - batch.seq_h)
        k = self.policy.choose(batch.rows, int(row_limits[live].max()))
        num_draft_h = np.zeros(batch.rows, np.int64)  # [rows] draft tokens each row may accept
        if k:
            num_draft_h[live] = np.minimum(row_limits[live], k)  # live rows' limits are >= 0
        # uploaded before any work of the step is queued, so the copy waits for nothing
        num_draft = torch.from_numpy(num_draft_h).to(self.device) if k else None
        watch = _Stopwatch(self.device)
        draft_token_ids, draft_probs = self._propose(batch, k) if k else (None, None)
        watch.mark()
        target_logits = self._verify(batch, draft_token_ids)
        watch.mark()
        output_token_ids, num_accepted = self._accept(batch, draft_token_ids, draft_probs, target_logits, num_draft)
        report = self._advance(batch, live, batch.active, output_token_ids, num_accepted, num_draft_h)  # the host sync
        watch.mark()
        t_draft, t_target, t_rest = watch.seconds()
        if self.max_k:
            self.policy.observe_step(batch.rows, k, t_draft, t_target, t_draft + t_target + t_rest)
        self._record(batch.rows, k, t_draft, t_target, t_draft + t_target + t_rest)
        self.stats.num_steps += 1
        yield from self._finish(batch, live, k, report)

    def _propose(self, batch: _Batch, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k draft tokens per row: ([rows, k] ids, [rows, k, V] probabilities, None when all greedy)."""
        assert self.draft is not None and batch.draft_cache is not None
        sampling = batch.sampling
        # The first pass feeds each row the tokens its draft cache lacks (one, or two after a step
        # that accepted everything, or more after steps without speculation).
        unseen = batch.seq_lens - batch.draft_lens  # [rows] >= 1
        width = int((batch.seq_h - batch.draft_h).max())
        columns = batch.draft_lens[:, None] + self._arange(width)  # [rows, width]
        columns = columns.clamp_(max=batch.capacity - 1)
        kv_length = min(int((batch.draft_h + width).max()), batch.capacity)
        logits = self._forward(self.draft, batch.draft_cache, batch.token_ids.gather(1, columns), columns, kv_length)
        last = logits.gather(1, (unseen - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])).squeeze(1)
        token_ids: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            if i:
                columns = (batch.seq_lens + (i - 1)).unsqueeze(1)  # [rows, 1]: d_i's column
                kv_length = int(batch.seq_h.max()) + i
                last = self._forward(
                    self.draft, batch.draft_cache, token_ids[-1].unsqueeze(1), columns, kv_length
                ).squeeze(1)  # [rows, V]
            if sampling.all_greedy:
                token_ids.append(last.argmax(dim=-1))
                continue
            p = logits_to_probs(last.unsqueeze(1), sampling).squeeze(1)  # [rows, V]
            uniforms = counter_uniforms(sampling.seeds, (batch.seq_lens + i).unsqueeze(1), Stream.DRAFT)
            token_ids.append(sample_from_probs(p, uniforms.squeeze(1)))
            probs.append(p)
        batch.draft_lens = batch.seq_lens + (k - 1)
        batch.draft_h = batch.seq_h + (k - 1)
        draft_token_ids = torch.stack(token_ids, dim=1)  # [rows, k]
        return draft_token_ids, (torch.stack(probs, dim=1) if probs else None)  # [rows, k, V]

    def _verify(self, batch: _Batch, draft_token_ids: torch.Tensor | None) -> torch.Tensor:
        """Target logits for the last token and every draft token: [rows, k + 1, V], one forward pass."""
        last_column = (batch.seq_lens - 1).unsqueeze(1)  # [rows, 1]
        last = batch.token_ids.gather(1, last_column)  # [rows, 1]
        inputs = last if draft_token_ids is None else torch.cat([last, draft_token_ids], dim=1)  # [rows, k + 1]
        width = inputs.shape[1]
        columns = last_column + self._arange(width)  # [rows, k + 1]
        kv_length = int(batch.seq_h.max()) - 1 + width
        return self._forward(self.target, batch.target_cache, inputs, columns, kv_length)

    def _accept(
        self,
        batch: _Batch,
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
        positions = batch.seq_lens.unsqueeze(1) + self._arange(width)  # [rows, k + 1]
        target_probs = logits_to_probs(target_logits, sampling)  # [rows, k + 1, V]
        target_uniforms = counter_uniforms(sampling.seeds, positions, Stream.TARGET)
        if self.config.strict:
            _check_probs(target_probs)
        if draft_token_ids is None:
            return sample_from_probs(target_probs, target_uniforms), None
        assert draft_probs is not None and num_draft is not None
        if self.config.strict:
            _check_probs(draft_probs)
        accept_uniforms = counter_uniforms(sampling.seeds, positions[:, :-1], Stream.ACCEPT)
        return rejection_sample(draft_token_ids, draft_probs, target_probs, accept_uniforms, target_uniforms, num_draft)

    def _advance(
        self,
        batch: _Batch,
        live: np.ndarray,
        active: torch.Tensor,
        output_token_ids: torch.Tensor,
        num_accepted: torch.Tensor | None,
        num_draft_h: np.ndarray,
    ) -> _StepReport:
        """Append the output of rows `live` (`active`: the same rows, a [rows] 0/1 mask on the device),
        roll both caches back per row, and find rows that ended.

        The device only appends and moves lengths; where a row ends (EOS, max_tokens) is worked out
        on the host copy of the step's few numbers, where small array operations cost far less.
        """
        width = output_token_ids.shape[1]
        emitted = active if num_accepted is None else (num_accepted + 1) * active  # [rows]
        if self.config.strict:
            assert int((batch.seq_lens + width).max()) <= batch.capacity
        batch.token_ids.scatter_(1, batch.seq_lens.unsqueeze(1) + self._arange(width), output_token_ids)
        batch.seq_lens = batch.seq_lens + emitted
        if self.draft is not None:
            # The target cache now holds seq_len_old + k tokens and should hold seq_len_new - 1: that is the
            # per-row rollback, implied by seq_lens. The draft saw at most seq_len_old + k - 1.
            batch.draft_lens = torch.minimum(batch.draft_lens, batch.seq_lens - 1)
        # the one host sync: [rows, k + 1] output ids (and [rows] accepted counts)
        if num_accepted is None:
            output_h, accepted_h = output_token_ids.cpu().numpy(), np.zeros(batch.rows, np.int64)
        else:
            host = torch.cat([num_accepted.unsqueeze(1), output_token_ids], dim=1).cpu().numpy()
            output_h, accepted_h = host[:, 1:], host[:, 0]
        active_h = np.zeros(batch.rows, np.int64)
        active_h[live] = 1
        accepted_h = accepted_h * active_h
        emitted_h = (accepted_h + 1) * active_h
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
        batch.draft_h = np.minimum(batch.draft_h, batch.seq_h - 1)
        return _StepReport(kept=kept, finish=finish, accepted=accepted_h, drafted=num_draft_h, output_ids=output_h)

    def _finish(self, batch: _Batch, live: np.ndarray, k: int, report: _StepReport) -> Iterator[GenerationResult]:
        """Book the step's tokens and counters for rows `live`; yield the results of those that ended."""
        kept, finish, accepted, drafted = report.kept, report.finish, report.accepted, report.drafted
        batch.generated_h += kept  # finished rows keep 0
        if k:
            accepted, drafted = accepted[live], drafted[live]
            batch.draft_tokens_h[live] += drafted
            batch.accepted_h[live] += accepted
            self.policy.observe_acceptance(accepted, drafted)
            self.stats.num_drafts += int((drafted > 0).sum())
            self.stats.num_draft_tokens += int(drafted.sum())
            self.stats.num_accepted_tokens += int(accepted.sum())
            for i in range(k):
                self.stats.accepted_per_position[i] += int((accepted > i).sum())
        finished: dict[int, tuple[str, list[int] | None]] = {}
        # Only rows that ended or watch for stop strings need the host; the rest stay vectorised.
        for row in live[(finish[live] != RUNNING) | batch.has_stops_h[live]]:
            slot = batch.slots[row]
            assert slot is not None
            if slot.stops is not None:
                tokens = report.output_ids[row, : kept[row]].tolist()
                cut = slot.stops.feed(tokens)
                if cut is not None:
                    finished[int(row)] = ("stop", cut)
                    continue
            if finish[row] != RUNNING:
                finished[int(row)] = ("stop" if finish[row] == FINISHED_STOP else "length", None)
        if not finished:
            return
        rows = sorted(finished)
        sequences = batch.token_ids[torch.tensor(rows, device=self.device)].cpu().numpy()
        now = time.perf_counter()
        for row, sequence in zip(rows, sequences, strict=True):
            slot = batch.slots[row]
            assert slot is not None
            reason, tokens = finished[row]
            if tokens is None:
                start = batch.prompt_h[row]
                tokens = sequence[start : start + batch.generated_h[row]].tolist()
            self.stats.num_generated_tokens += len(tokens)
            yield GenerationResult(
                key=slot.request.key,
                token_ids=tokens,
                text=self._decode(tokens),
                finish_reason=reason,  # type: ignore[arg-type]
                prompt_tokens=int(batch.prompt_h[row]),
                completion_tokens=len(tokens),
                draft_tokens=int(batch.draft_tokens_h[row]),
                accepted_tokens=int(batch.accepted_h[row]),
                seed=slot.seed,
                latency_s=now - slot.started,
            )
            batch.slots[row] = None
        dead = torch.tensor(rows, device=self.device)
        batch.active[dead] = 0
        # A finished row idles at length 1 until it is reused or dropped: cheap, and never NaN.
        batch.seq_lens[dead], batch.draft_lens[dead] = 1, 0
        batch.seq_h[rows], batch.draft_h[rows] = 1, 0
        batch.has_stops_h[rows] = False

    # -- model calls --------------------------------------------------------------------------------
    def _forward(
        self, model, cache: RaggedKVCache, input_ids: torch.Tensor, columns: torch.Tensor, kv_length: int
    ) -> torch.Tensor:
        """Logits [rows, T, V] for `input_ids` [rows, T] written at `columns` [rows, T] of each row."""
        cache.plan_step(columns, kv_length)
        return self._run(model, cache, input_ids, columns)

    def _run(
        self,
        model,
        cache: RaggedKVCache,
        input_ids: torch.Tensor,
        columns: torch.Tensor,
        keep: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Logits [rows, T, V]; with `keep`, only at those positions ([rows, len(keep), V]; an int: the last
        `keep`), which models that take `logits_to_keep` compute alone; the others compute them all."""
        kv_length = cache.plan.kv_length
        allowed = self._arange(kv_length) <= columns.unsqueeze(-1)  # [rows, T, kv_length]
        mask = _attention_mask(model, allowed.unsqueeze(1))  # [rows, 1, T, kv_length]
        kwargs = {_cache_kwarg(model): cache, "use_cache": True}
        if keep is not None and _accepts(model, "logits_to_keep"):
            kwargs["logits_to_keep"] = keep
        # Padding past a row's context gets a clamped position; its outputs are never used.
        positions = columns if kv_length <= self.max_context else columns.clamp(max=self.max_context - 1)
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, **kwargs).logits
        if model is self.draft:
            self.stats.draft_forwards += 1
        else:
            self.stats.target_forwards += 1
        if out.shape[-1] < self.vocab_size:  # a smaller vocabulary: the missing ids get probability 0
            out = torch.nn.functional.pad(out, (0, self.vocab_size - out.shape[-1]), value=float("-inf"))
        return out

    def _record(self, rows: int, k: int, t_draft: float, t_target: float, t_step: float) -> None:
        stats = self.stats
        stats.time_draft_s += t_draft
        stats.time_target_s += t_target
        stats.k_steps[k] = stats.k_steps.get(k, 0) + 1
        if k:
            stats.add_time(f"draft@{rows}", t_draft, count=k)
        stats.add_time(f"target:{k + 1}@{rows}", t_target)
        stats.add_time(f"step:{k}@{rows}", t_step)

    def _arange(self, n: int) -> torch.Tensor:
        """torch.arange(n) on the device, from a cached one (a step needs several)."""
        if self._aranges.numel() < n:
            self._aranges = torch.arange(max(n, 2 * self._aranges.numel()), device=self.device)
        return self._aranges[:n]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# -- helpers ----------------------------------------------------------------------------------------
def _check_probs(probs: torch.Tensor) -> None:
    total = probs.sum(-1)
    assert torch.allclose(total, torch.ones_like(total), atol=1e-4), "probabilities do not sum to 1"
    assert bool((probs >= 0).all()), "negative probability"


def _attention_mask(model, allowed: torch.Tensor) -> torch.Tensor:
    # SDPA and flex take a boolean mask; the eager path adds the mask to the scores.
    if getattr(model.config, "_attn_implementation", "sdpa") == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )
    return allowed


_SIGNATURES: dict[type, set[str]] = {}


def _accepts(model, name: str) -> bool:
    params = _SIGNATURES.get(type(model))
    if params is None:
        params = _SIGNATURES[type(model)] = set(inspect.signature(model.forward).parameters)
    return name in params


def _cache_kwarg(model) -> str:
    # transformers renamed `past_key_values` to `cache` during 5.x.
    return "cache" if _accepts(model, "cache") else "past_key_values"


def _num_layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def _vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def _max_context(model) -> int:
    return int(getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2**31)


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


def _start_token_id(tokenizer) -> int | None:
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    return None
