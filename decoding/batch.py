"""The rows being decoded: each row's sequence and lengths on the device, their host mirrors, the target's
KV cache, and the request that owns each row.

Rows are admitted into free slots (or new rows), released when their request ends, and compacted
away once no request waits. A proposer keeps per-row state of its own (a draft model's cache and
lengths); it follows every change of the rows through `RowState.resize` and `RowState.release`.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from specq.decoding.hf_model import Tokenizer, decode
from specq.decoding.kv_cache import RaggedKVCache
from specq.decoding.logprobs import LogprobBuffers
from specq.decoding.prefix_reuse import HeldPrompts
from specq.decoding.sampling import SamplingTensors
from specq.decoding.static_shapes import capacity_bucket, row_bucket
from specq.decoding.stopping import StopChecker
from specq.decoding.types import FinishReason, GenerationRequest, GenerationResult

_CAPACITY_QUANTUM = 64  # cache columns are allocated in multiples of this, to grow rarely


class RowState(Protocol):
    """State kept per row outside the batch (a proposer's), which follows the batch's rows."""

    def release(self, rows: list[int], rows_t: torch.Tensor) -> None:
        """These rows' requests ended (`rows_t`: the same rows on the device); the rows idle until reused
        or dropped."""
        ...

    def resize(self, rows: int, capacity: int, keep: np.ndarray | None) -> None:
        """Keep rows `keep` (None: all) first, in that order, then add empty rows up to `rows`; make room
        for `capacity` tokens a row."""
        ...


@dataclass
class Slot:
    """Host-side state of one live request."""

    request: GenerationRequest
    seed: int
    started: float
    stops: StopChecker | None
    first_token_at: float | None = None  # perf_counter() when its first output token was kept


@dataclass
class Admission:
    """Requests just placed into rows, their prompts written; what the prefills need."""

    rows: np.ndarray  # [n] int64
    rows_t: torch.Tensor  # [n] int64, the same rows on the device
    prompt_ids: torch.Tensor  # [n, width] int64, right-padded with 0
    prompt_lens: np.ndarray  # [n] int64


@dataclass
class Appended:
    """What the host learns of a step's appended tokens, [rows] host arrays (0 for rows not appended to)."""

    output_ids: np.ndarray  # [rows, k + 1] the accepted tokens and the recovered or bonus token, then padding
    accepted: np.ndarray  # draft tokens accepted
    emitted: np.ndarray  # tokens appended to the row's sequence (accepted + 1)
    nonfinite_at: np.ndarray  # the first output position whose target logits were not finite (k + 1: none)


class BatchState:
    """Device tensors drive the models; host arrays mirror what sizes and endings need, so the step reads
    the device once."""

    def __init__(
        self,
        target_cache: RaggedKVCache,
        device: torch.device,
        proposer: RowState | None,
        reproducible: bool = False,
        static_rows: int | None = None,
    ) -> None:
        """`static_rows`: the batch size, where rows and capacity come in the static path's sizes
        (decoding/static_shapes.py); None: rows as admitted, capacity in multiples of 64 columns."""
        self.device = device
        self.reproducible = reproducible  # sampling by the coupled race (decoding/sampling.py)
        self.static_rows = static_rows
        self.proposer = proposer
        self.token_ids = torch.zeros(0, 0, dtype=torch.int64, device=device)  # [rows, capacity], left-aligned
        self.seq_lens = torch.zeros(0, dtype=torch.int64, device=device)  # [rows]
        # [rows] 1 for a live row, 0 for a finished row that waits to be reused or dropped
        self.active = torch.zeros(0, dtype=torch.int64, device=device)
        self.target_cache = target_cache
        self.held_prompts = HeldPrompts()  # the prompt each row's target cache columns hold
        self.sampling = SamplingTensors.build([], [], device, reproducible=reproducible)
        self.slots: list[Slot | None] = []
        # host mirrors, [rows] int64
        self.seq_h = np.zeros(0, np.int64)
        self.prompt_h = np.zeros(0, np.int64)
        self.max_tokens_h = np.zeros(0, np.int64)
        self.generated_h = np.zeros(0, np.int64)
        self.draft_tokens_h = np.zeros(0, np.int64)
        self.accepted_h = np.zeros(0, np.int64)
        self.has_stops_h = np.zeros(0, bool)
        # per row: the alternatives its request wants with log-probabilities; -1: none wanted
        self.logprobs_h = np.zeros(0, np.int64)
        # the log-probabilities of the tokens at each column (LogprobBuffers), allocated once a row asks
        self.logprob_buffers: LogprobBuffers | None = None
        self._aranges = torch.arange(1024, device=device)

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def capacity(self) -> int:
        return self.token_ids.shape[1]

    def live_rows(self) -> np.ndarray:
        return np.array([i for i, slot in enumerate(self.slots) if slot is not None], dtype=np.int64)

    def num_live(self) -> int:
        return sum(slot is not None for slot in self.slots)

    def arange(self, n: int) -> torch.Tensor:
        """torch.arange(n) on the device, from a cached one (a step needs several)."""
        if self._aranges.numel() < n:
            self._aranges = torch.arange(max(n, 2 * self._aranges.numel()), device=self.device)
        return self._aranges[:n]

    # -- a step's tokens ------------------------------------------------------------------------------
    def append(
        self,
        output_token_ids: torch.Tensor,
        *,
        num_accepted: torch.Tensor | None,
        nonfinite_at: torch.Tensor,
        rows: np.ndarray,
        mask: torch.Tensor,
    ) -> Appended:
        """Append each of `rows`' output and move its length, on the device and on the host together: row
        b gains its first num_accepted[b] + 1 of `output_token_ids` [rows, k + 1] (one without draft
        tokens, num_accepted None). `mask`: `rows` as a [rows] 0/1 tensor on the device. `nonfinite_at`
        [rows]: each row's first output position from logits that were not finite, read with the rest.

        The device only appends and moves lengths, then the host reads the step's few numbers once (the
        step's one sync) and moves its mirror of the lengths."""
        width = output_token_ids.shape[1]
        emitted = mask if num_accepted is None else (num_accepted + 1) * mask  # [rows]
        self.token_ids.scatter_(1, self.seq_lens.unsqueeze(1) + self.arange(width), output_token_ids)
        # The target cache now holds seq_len_old + k tokens and should hold seq_len_new - 1: that is the
        # per-row rollback, implied by seq_lens.
        self.seq_lens = self.seq_lens + emitted
        accepted = torch.zeros_like(nonfinite_at) if num_accepted is None else num_accepted  # [rows]
        counts = torch.stack([accepted, nonfinite_at], dim=1)  # [rows, 2]
        host = torch.cat([counts, output_token_ids], dim=1).cpu().numpy()  # [rows, k + 3]
        accepted_h, nonfinite_h, output_h = host[:, 0], host[:, 1], host[:, 2:]
        mask_h = np.zeros(self.rows, np.int64)  # [rows]
        mask_h[rows] = 1
        accepted_h = accepted_h * mask_h
        emitted_h = (accepted_h + 1) * mask_h  # [rows]
        self.seq_h = self.seq_h + emitted_h
        return Appended(output_ids=output_h, accepted=accepted_h, emitted=emitted_h, nonfinite_at=nonfinite_h)

    def record_logprobs(self, target_logits: torch.Tensor, output_token_ids: torch.Tensor, *, vocab_size: int) -> None:
        """Record, for the rows that asked, the log-probabilities of the step's output tokens [rows, k + 1]
        at the columns they go to (decoding/logprobs.py); no host sync (the rows come from the host mirror)."""
        asking = np.flatnonzero(self.logprobs_h >= 0)
        if self.logprob_buffers is None or asking.size == 0:
            return
        rows_t = torch.from_numpy(asking).to(self.device)  # [n]
        columns = self.seq_lens.index_select(0, rows_t).unsqueeze(1) + self.arange(output_token_ids.shape[1])
        self.logprob_buffers.record(rows_t, columns, target_logits, output_token_ids, vocab_size=vocab_size)

    def count_drafts(self, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """Book `rows`' draft tokens offered and accepted this step ([len(rows)] each)."""
        self.draft_tokens_h[rows] += drafted
        self.accepted_h[rows] += accepted

    def keep(self, rows: np.ndarray, kept: np.ndarray, now: float) -> None:
        """Book the tokens each of `rows` keeps in its completion this step (`kept` [rows]: 0 for the others);
        a row keeping its first tokens has them at `now`."""
        self.generated_h += kept
        for row in rows[(self.generated_h[rows] == kept[rows]) & (kept[rows] > 0)]:
            slot = self.slots[row]
            assert slot is not None
            slot.first_token_at = now

    def finish(
        self, ended: dict[int, tuple[FinishReason, list[int] | None]], now: float, tokenizer: Tokenizer
    ) -> list[GenerationResult]:
        """The results of the requests of rows `ended` (row -> (finish reason, the completion where a stop
        string cut it, else None: every kept token)), their sequences read from the device at once; their
        rows are released."""
        rows = sorted(ended)
        sequences = self.token_ids[torch.tensor(rows, device=self.device)].cpu().numpy()  # [ended, capacity]
        results = []
        for row, sequence in zip(rows, sequences, strict=True):
            slot = self.slots[row]
            assert slot is not None
            reason, cut = ended[row]
            start, wanted, buffers = int(self.prompt_h[row]), int(self.logprobs_h[row]), self.logprob_buffers
            tokens = sequence[start : start + self.generated_h[row]].tolist() if cut is None else cut
            # a stop string that begins inside a token cuts the text there, not at a token (stopping.py)
            cut_text = None if cut is None or slot.stops is None else slot.stops.cut_text
            result = GenerationResult(
                key=slot.request.key,
                token_ids=tokens,
                text=decode(tokenizer, tokens) if cut_text is None else cut_text,
                finish_reason=reason,
                prompt_tokens=start,
                completion_tokens=len(tokens),
                draft_tokens=int(self.draft_tokens_h[row]),
                accepted_tokens=int(self.accepted_h[row]),
                seed=slot.seed,
                latency_s=now - slot.started,
                first_token_s=None if slot.first_token_at is None else slot.first_token_at - slot.started,
                # a stop string cuts the tokens, and so their log-probabilities
                logprobs=None if buffers is None or wanted < 0 else buffers.read(row, start, tokens, wanted, tokenizer),
            )
            results.append(result)
        self.release(rows)
        return results

    def fail(self, errors: dict[int, str]) -> list[GenerationResult]:
        """The failed results of rows `errors` (row -> error), whose rows are released. A row that fails
        mid-decoding may hold non-finite keys and values: its target cache is zeroed, since a later request
        in the row reads its stale columns under the mask (and 0 x NaN is NaN), and its prompt forgotten."""
        rows = sorted(errors)
        results = []
        for row in rows:
            slot = self.slots[row]
            assert slot is not None
            results.append(GenerationResult.failed(slot.request.key, errors[row], int(self.prompt_h[row])))
        self.target_cache.zero_rows(torch.tensor(rows, device=self.device))
        self.held_prompts.forget(rows)
        self.release(rows)
        return results

    # -- admit, release, compact --------------------------------------------------------------------
    def admit(self, requests: list[GenerationRequest], tokenizer: Tokenizer, extra_columns: int) -> Admission:
        """Place `requests` into free rows (new ones past them) and write their prompts; each row gets room
        for its prompt, its max_tokens and `extra_columns` more (a step's draft tokens)."""
        need = max(len(r.prompt_token_ids) + r.params.max_tokens for r in requests) + extra_columns
        rows = [i for i, slot in enumerate(self.slots) if slot is None][: len(requests)]
        extra = len(requests) - len(rows)
        rows += list(range(self.rows, self.rows + extra))
        self._resize(self.rows + extra, max(self.capacity, need))
        now = time.perf_counter()
        for row, request in zip(rows, requests, strict=True):
            params = request.params
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            stops = StopChecker(tokenizer, params.stop) if params.stop else None
            self.slots[row] = Slot(request, seed, now, stops)
            self.has_stops_h[row] = stops is not None
            self.logprobs_h[row] = -1 if params.logprobs is None else params.logprobs

        prompts = [list(r.prompt_token_ids) for r in requests]
        width = max(len(p) for p in prompts)
        prompt_ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)  # [n, width]
        rows_t = torch.tensor(rows, device=self.device)  # [n]
        rows_h = np.array(rows, np.int64)
        lengths_h = np.array([len(p) for p in prompts], np.int64)  # [n]
        self.token_ids[rows_t, :width] = prompt_ids
        self.seq_lens[rows_t] = torch.from_numpy(lengths_h).to(self.device)
        self.active[rows_t] = 1
        self.seq_h[rows_h] = self.prompt_h[rows_h] = lengths_h
        self.max_tokens_h[rows_h] = [r.params.max_tokens for r in requests]
        self.generated_h[rows_h] = self.draft_tokens_h[rows_h] = self.accepted_h[rows_h] = 0
        top = int(self.logprobs_h.max(initial=-1))
        if top >= 0 and (self.logprob_buffers is None or self.logprob_buffers.top < top):
            self.logprob_buffers = LogprobBuffers.grown(
                self.logprob_buffers, self.rows, self.capacity, top, self.device
            )
        self._refresh_sampling()
        return Admission(rows=rows_h, rows_t=rows_t, prompt_ids=prompt_ids, prompt_lens=lengths_h)

    def release(self, rows: list[int]) -> None:
        """Free the rows of requests that ended."""
        for row in rows:
            self.slots[row] = None
        rows_t = torch.tensor(rows, device=self.device)  # [ended]
        self.active[rows_t] = 0
        # A finished row idles at length 1 until it is reused or dropped: cheap, and never NaN.
        self.seq_lens[rows_t] = 1
        self.seq_h[rows] = 1
        self.has_stops_h[rows] = False
        self.logprobs_h[rows] = -1
        if self.proposer is not None:
            self.proposer.release(rows, rows_t)

    def compactable(self) -> bool:
        """Whether dropping the finished rows makes the batch smaller: some rows are live and some not (with
        static shapes: the live rows fit a smaller size)."""
        live = self.num_live()
        if self.static_rows is not None:  # a batch size that is not a power of two is a size of its own
            return live > 0 and row_bucket(live, self.static_rows) < self.rows
        return 0 < live < self.rows

    def compact(self) -> None:
        """Drop the finished rows (called once no request waits, where `compactable`)."""
        live = self.live_rows()
        self._resize(rows=live.size, capacity=self.capacity, keep=live)

    def _resize(self, rows: int, capacity: int, keep: np.ndarray | None = None) -> None:
        """Keep rows `keep` (default: all) first, then add empty rows up to `rows`; grow to `capacity`."""
        if self.static_rows is None:
            capacity = -(-capacity // _CAPACITY_QUANTUM) * _CAPACITY_QUANTUM
        else:
            rows, capacity = row_bucket(rows, self.static_rows), capacity_bucket(capacity)
        if keep is None and rows == self.rows and capacity == self.capacity:
            return
        keep_t = None if keep is None else torch.as_tensor(keep, device=self.device)
        kept = self.rows if keep is None else len(keep)
        add = rows - kept

        def device_rows(t: torch.Tensor, fill: int) -> torch.Tensor:
            t = t if keep_t is None else t.index_select(0, keep_t)
            return torch.cat([t, torch.full((add, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)])

        def host_rows(a: np.ndarray, fill: int) -> np.ndarray:
            a = a if keep is None else a[keep]
            return np.concatenate([a, np.full(add, fill, a.dtype)])

        token_ids = self.token_ids if keep_t is None else self.token_ids.index_select(0, keep_t)
        self.token_ids = torch.zeros(rows, capacity, dtype=torch.int64, device=self.device)
        width = min(token_ids.shape[1], capacity)
        self.token_ids[:kept, :width] = token_ids[:, :width]
        self.seq_lens, self.active = device_rows(self.seq_lens, 1), device_rows(self.active, 0)
        self.target_cache.resize(rows, capacity, keep_t)
        self.held_prompts.resize(rows, keep)
        self.seq_h, self.prompt_h = host_rows(self.seq_h, 1), host_rows(self.prompt_h, 0)
        self.max_tokens_h, self.generated_h = host_rows(self.max_tokens_h, 1), host_rows(self.generated_h, 0)
        self.draft_tokens_h, self.accepted_h = host_rows(self.draft_tokens_h, 0), host_rows(self.accepted_h, 0)
        self.has_stops_h = host_rows(self.has_stops_h, 0)
        self.logprobs_h = host_rows(self.logprobs_h, -1)
        if self.logprob_buffers is not None:
            self.logprob_buffers = self.logprob_buffers.resized(rows, capacity, keep_t)
        slots = self.slots if keep is None else [self.slots[i] for i in keep]
        self.slots = slots + [None] * add
        if self.proposer is not None:
            self.proposer.resize(rows, capacity, keep)
        self._refresh_sampling()

    def _refresh_sampling(self) -> None:
        self.sampling = SamplingTensors.build(
            [slot.request.params if slot else None for slot in self.slots],
            [slot.seed if slot else 0 for slot in self.slots],
            self.device,
            reproducible=self.reproducible,
        )
