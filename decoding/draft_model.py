"""A small causal LM as the proposer: k autoregressive draft forward passes, one token each (Leviathan
et al. 2023, Algorithm 1, lines 1-4; Chen et al. 2023's draft model).

The draft keeps its own `RaggedKVCache` and, per row, `draft_lens`: how many tokens of the row's
sequence that cache holds. Invariant between steps: `draft_lens <= seq_lens - 1`. A proposal's first
forward pass catches each row up on the tokens its cache lacks (one, or two after a step that
accepted every draft token), then each further pass feeds the draft token just sampled. A row further
behind (steps without speculation, or looked-up proposals taken) is read first, as a prefill. After
the step, `advance` rolls a row back to what the target kept.

A row's prompt is read at the first proposal after its admission, not at admission, as a prefill of
the new rows alone (in the catch-up pass it would widen every row to a whole prompt): a row decoded
while the policy rests, or on the hybrid's looked-up proposals alone, never costs a draft prefill.
On a compute-bound batch (a CPU at 16 rows) the draft model's prefill of every prompt was a tenth of
a templated job's time even where the policy then never drafted.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from specq.decoding.hf_model import RaggedLM
from specq.decoding.prefix_reuse import HeldPrompts
from specq.decoding.proposer import Offer
from specq.decoding.sampling import Stream, counter_uniforms, logits_to_probs, race_sample, sample_from_probs
from specq.decoding.static_shapes import width_bucket
from specq.decoding.stats import DRAFT_MODEL

if TYPE_CHECKING:
    from specq.decoding.batch import Admission, BatchState
    from specq.decoding.stats import EngineStats

# the most tokens a row's cache lacks after a step the draft model proposed for: the target's own token,
# and the last draft token when all were accepted; a row further behind is read as a prefill first
_CATCH_UP = 2


class DraftModelProposer:
    """Implements `Proposer` with a draft model that shares the target's tokenizer and device.

    The two models may have embedding tables of different sizes (families pad them to a multiple of
    64 or 128; Qwen2.5 has 151,936 rows up to 7B and 152,064 from 14B). The draft never proposes an id
    the target cannot read (its probability there is 0), and ids the draft cannot read (the target's
    extra rows, emitted or in the prompt) reach it as its own last id: what the draft conditions on
    changes only its proposals, never which tokens the target keeps."""

    def __init__(self, lm: RaggedLM, max_k: int, vocab_size: int, target_vocab_size: int) -> None:
        self.lm = lm
        self.max_k = max_k
        self.vocab_size = vocab_size  # logits are padded to it, so draft_probs match target_probs
        self.target_vocab_size = target_vocab_size
        device = self.lm.device
        self.cache = self.lm.new_cache(0, 0)
        self.draft_lens = torch.zeros(0, dtype=torch.int64, device=device)  # [rows]
        self.draft_h = np.zeros(0, np.int64)  # [rows], host mirror: sizes the forward passes without a sync
        self.unread = np.zeros(0, bool)  # [rows] admitted rows whose sequence the cache has not read yet
        self.held_prompts = HeldPrompts()  # the prompt each row's draft cache columns hold

    def admit(self, batch: BatchState, admission: Admission, stats: EngineStats) -> None:
        self.draft_lens[admission.rows_t] = 0
        self.draft_h[admission.rows] = 0
        self.unread[admission.rows] = True

    def _read_behind(self, batch: BatchState, stats: EngineStats) -> None:
        """Prefill what the cache lacks of each row beyond a step's catch-up, up to all but the row's
        last token (the catch-up feeds that one): a row admitted since the last proposal reads its
        sequence after the head of its prompt that a row of this cache holds (decoding/prefix_reuse.py),
        and a row the draft model skipped (the policy resting, or the row taking looked-up proposals)
        reads the tokens decoded meanwhile. Counted as prefill time, not drafting: the time a proposal
        then takes is that of its usual one- or two-token catch-up, which the policy prices speculation
        by; a wide catch-up after a rest made a probe's drafting look several times dearer, and the
        policy then rested on."""
        # no per-row loop over the slots: an idle row is 1 token long and its cache empty, so never behind
        behind = np.flatnonzero(self.unread | (batch.seq_h - self.draft_h > _CATCH_UP))
        if behind.size == 0:
            return
        started = time.perf_counter()
        new = self.unread[behind]  # [n]
        self.unread[behind] = False
        ends = batch.seq_h[behind] - 1  # [n]
        starts = self.draft_h[behind].copy()  # [n]
        rows_t = torch.from_numpy(behind).to(self.lm.device)  # [n]
        # the part of each new row's prompt it reads (all of it once the row's first token is decoded)
        new_rows = behind[new]
        prompts = [_slot_prompt(batch, row)[:n] for row, n in zip(new_rows.tolist(), ends[new].tolist(), strict=True)]
        if new_rows.size:
            new_rows_t = torch.from_numpy(new_rows).to(self.lm.device)
            starts[new] = self.held_prompts.lend(self.cache, new_rows, new_rows_t, prompts)
        lengths = ends - starts  # [n]
        reading = np.flatnonzero(lengths > 0)  # [r]
        if reading.size:
            width = int(lengths.max())
            starts_t = torch.from_numpy(starts[reading]).to(self.lm.device)  # [r]
            columns = (starts_t.unsqueeze(1) + batch.arange(width)).clamp_(max=batch.capacity - 1)  # [r, width]
            read_t = rows_t[torch.from_numpy(reading).to(self.lm.device)]  # [r]
            inputs = self._readable(batch.token_ids[read_t].gather(1, columns))  # [r, width], right-padded
            _, forwards = self.lm.prefill_rows(
                self.cache, behind[reading], inputs, lengths[reading], self.vocab_size, starts[reading]
            )
            stats.draft_forwards += forwards
        self.held_prompts.record(new_rows.tolist(), prompts)
        self.draft_lens[rows_t] = batch.seq_lens[rows_t] - 1
        self.draft_h[behind] = ends
        stats.time_prefill_s += time.perf_counter() - started

    def offer(self, batch: BatchState, live: np.ndarray, limits: np.ndarray) -> Offer:
        lengths = np.zeros(batch.rows, np.int64)
        lengths[live] = np.minimum(limits[live], self.max_k)
        return Offer(lengths, np.full(batch.rows, DRAFT_MODEL, np.int64))

    def propose(
        self, batch: BatchState, k: int, num_draft_h: np.ndarray, stats: EngineStats
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        sampling = batch.sampling
        self._read_behind(batch, stats)
        # The catch-up pass: row b feeds its columns [draft_lens[b], seq_lens[b]), right-padded to `width`.
        unseen = batch.seq_lens - self.draft_lens  # [rows] >= 1
        width = int((batch.seq_h - self.draft_h).max())
        if self.lm.static:  # a catch-up of each width would be a graph of its own
            width = width_bucket(width)
        columns = self.draft_lens[:, None] + batch.arange(width)  # [rows, width]
        columns = columns.clamp_(max=batch.capacity - 1)
        kv_length = min(int((self.draft_h + width).max()), batch.capacity)
        input_ids = self._readable(batch.token_ids.gather(1, columns))  # [rows, width]
        logits = self._forward(input_ids, columns, kv_length, stats)  # [rows, width, V]
        last_logits = logits.gather(1, (unseen - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])).squeeze(
            1
        )  # [rows, V]
        token_ids: list[torch.Tensor] = []  # k of [rows]
        probs: list[torch.Tensor] = []  # k of [rows, V]
        for i in range(k):
            if i:
                columns = (batch.seq_lens + (i - 1)).unsqueeze(1)  # [rows, 1]: draft token i - 1's column
                kv_length = int(batch.seq_h.max()) + i
                last_logits = self._forward(token_ids[-1].unsqueeze(1), columns, kv_length, stats).squeeze(1)
            if sampling.all_greedy:
                token_ids.append(last_logits.argmax(dim=-1))  # [rows]
                continue
            position_probs = logits_to_probs(last_logits.unsqueeze(1), sampling).squeeze(1)  # [rows, V]
            positions = (batch.seq_lens + i).unsqueeze(1)  # [rows, 1]
            if sampling.reproducible:  # the target's noise at this position: the coupling
                token_ids.append(race_sample(position_probs.unsqueeze(1), sampling.seeds, positions).squeeze(1))
            else:
                uniforms = counter_uniforms(sampling.seeds, positions, Stream.DRAFT)  # [rows, 1]
                token_ids.append(sample_from_probs(position_probs, uniforms.squeeze(1)))
            probs.append(position_probs)
        # rows without a request were fed at length 1 too, over their first columns
        self.held_prompts.forget_idle(batch.live_rows())
        # The last draft token is never fed: the cache now holds the sequence and draft tokens 0..k-2.
        self.draft_lens = batch.seq_lens + (k - 1)
        self.draft_h = batch.seq_h + (k - 1)
        draft_token_ids = torch.stack(token_ids, dim=1)  # [rows, k]
        draft_probs = torch.stack(probs, dim=1) if probs else None  # [rows, k, V]
        return draft_token_ids, draft_probs

    def forget_drafts(self, rows_t: torch.Tensor, seq_lens: torch.Tensor, seq_h: np.ndarray, rows: np.ndarray) -> None:
        """Rows `rows` (`rows_t` on the device) take another proposer's draft tokens this step: the cache is
        valid only up to their sequence, not along its own draft tokens."""
        self.draft_lens[rows_t] = torch.minimum(self.draft_lens[rows_t], seq_lens[rows_t])
        self.draft_h[rows] = np.minimum(self.draft_h[rows], seq_h[rows])

    def advance(
        self, batch: BatchState, output_ids: np.ndarray | None = None, emitted: np.ndarray | None = None
    ) -> None:
        # Accepted tokens are the draft's own, so the cache stays valid up to the first rejected one;
        # the last output token (recovered or bonus) is new to the draft either way.
        self.draft_lens = torch.minimum(self.draft_lens, batch.seq_lens - 1)
        self.draft_h = np.minimum(self.draft_h, batch.seq_h - 1)

    def release(self, rows: list[int], rows_t: torch.Tensor) -> None:
        self.draft_lens[rows_t] = 0
        self.draft_h[rows] = 0
        self.unread[rows] = False

    def resize(self, rows: int, capacity: int, keep: np.ndarray | None) -> None:
        device = self.draft_lens.device
        keep_t = None if keep is None else torch.as_tensor(keep, device=device)
        # rows past `rows` without `keep`: a new batch on a proposer that served a larger one
        kept_lens = (self.draft_lens if keep_t is None else self.draft_lens.index_select(0, keep_t))[:rows]
        kept_h = (self.draft_h if keep is None else self.draft_h[keep])[:rows]
        add = rows - kept_lens.shape[0]
        self.draft_lens = torch.cat([kept_lens, torch.zeros(add, dtype=torch.int64, device=device)])
        self.draft_h = np.concatenate([kept_h, np.zeros(add, np.int64)])
        kept_unread = (self.unread if keep is None else self.unread[keep])[:rows]
        self.unread = np.concatenate([kept_unread, np.zeros(add, bool)])
        self.cache.resize(rows, capacity, keep_t)
        self.held_prompts.resize(rows, keep)

    def _forward(
        self, input_ids: torch.Tensor, columns: torch.Tensor, kv_length: int, stats: EngineStats
    ) -> torch.Tensor:
        stats.draft_forwards += 1
        logits = self.lm.step(self.cache, input_ids, columns, kv_length, self.vocab_size)  # [rows, T, V]
        if self.lm.vocab_size > self.target_vocab_size:  # ids the target cannot read are never proposed
            logits[..., self.target_vocab_size :] = float("-inf")
        return logits

    def _readable(self, token_ids: torch.Tensor) -> torch.Tensor:
        """`token_ids` with the ids past the draft's embedding table replaced by its last id."""
        if self.lm.vocab_size >= self.target_vocab_size:
            return token_ids
        return token_ids.clamp(max=self.lm.vocab_size - 1)


def _slot_prompt(batch: BatchState, row: int) -> tuple[int, ...]:
    slot = batch.slots[row]
    assert slot is not None  # a row is read only while its request is live
    return tuple(slot.request.prompt_token_ids)
