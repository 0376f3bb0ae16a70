"""Log-probabilities of output tokens, kept apart from sampling (as vLLM keeps them out of its sampler).

What a request with `logprobs` gets for each token of its completion: the target's raw log-probability
of the token (its log-softmax before temperature, top-k and top-p, as OpenAI reports them) and of the
likeliest alternatives. A step writes them on the device at the columns its tokens go to
(`LogprobBuffers.record`, no host sync); they are read once, when the row's request ends (`read`). Rows
that did not ask cost nothing (`BatchState.record_logprobs` picks the rows that did).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specq.decoding.hf_model import Tokenizer, decode
from specq.decoding.types import TokenLogprob


@dataclass
class LogprobBuffers:
    """The target's log-probabilities of the token at each column of each row, written in the step that
    emits the token (on the device, no sync) and read once, when the row's request ends."""

    chosen: torch.Tensor  # [rows, capacity] float32: the token's own log-probability
    top_values: torch.Tensor  # [rows, capacity, top] float32: the `top` likeliest tokens' log-probabilities
    top_ids: torch.Tensor  # [rows, capacity, top] int64: their ids

    @property
    def top(self) -> int:
        return self.top_values.shape[-1]

    @classmethod
    def grown(
        cls, old: LogprobBuffers | None, rows: int, capacity: int, top: int, device: torch.device
    ) -> LogprobBuffers:
        """Buffers for `top` alternatives, holding what `old` (None: nothing) held."""
        new = cls(
            torch.zeros(rows, capacity, device=device),
            torch.zeros(rows, capacity, top, device=device),
            torch.zeros(rows, capacity, top, dtype=torch.int64, device=device),
        )
        if old is not None:
            new.chosen.copy_(old.chosen)
            new.top_values[..., : old.top] = old.top_values
            new.top_ids[..., : old.top] = old.top_ids
        return new

    def resized(self, rows: int, capacity: int, keep: torch.Tensor | None) -> LogprobBuffers:
        """Rows `keep` (None: all) first, then zeroed rows up to `rows`, `capacity` columns each."""

        def fit(t: torch.Tensor) -> torch.Tensor:
            t = t if keep is None else t.index_select(0, keep)
            out = t.new_zeros(rows, capacity, *t.shape[2:])
            width = min(t.shape[1], capacity)
            out[: t.shape[0], :width] = t[:, :width]
            return out

        return LogprobBuffers(fit(self.chosen), fit(self.top_values), fit(self.top_ids))

    def record(
        self,
        rows_t: torch.Tensor,
        columns: torch.Tensor,
        target_logits: torch.Tensor,
        output_token_ids: torch.Tensor,
        *,
        vocab_size: int,
    ) -> None:
        """Write rows `rows_t` [n]' log-probabilities, at `columns` [n, k + 1], of their output tokens
        (`output_token_ids` [rows, k + 1]) and of the likeliest alternatives, under the logits the step
        verified with (`target_logits` [rows, k + 1, V]; past `vocab_size`: padding for a larger draft
        vocabulary). Tokens past what a row keeps are overwritten later or never read."""
        width = output_token_ids.shape[1]
        logprobs = target_logits.index_select(0, rows_t)[..., :vocab_size].float().log_softmax(dim=-1)  # [n, k + 1, V]
        outputs = output_token_ids.index_select(0, rows_t)  # [n, k + 1]
        row_index = rows_t.unsqueeze(1).expand(-1, width)  # [n, k + 1]
        self.chosen[row_index, columns] = logprobs.gather(-1, outputs.unsqueeze(-1)).squeeze(-1)  # [n, k + 1]
        if self.top:
            top_values, top_ids = logprobs.topk(self.top, dim=-1)  # [n, k + 1, top]
            self.top_values[row_index, columns] = top_values
            self.top_ids[row_index, columns] = top_ids

    def read(self, row: int, start: int, tokens: list[int], wanted: int, tokenizer: Tokenizer) -> list[TokenLogprob]:
        """Row `row`'s `tokens` (from column `start`) with their log-probabilities and `wanted` alternatives
        each: two reads, the values (the token's own first) and the alternatives' ids."""
        end = start + len(tokens)
        own = self.chosen[row, start:end, None]  # [n, 1]
        values = torch.cat([own, self.top_values[row, start:end, :wanted]], dim=1).tolist()  # [n, 1 + wanted]
        top_ids = self.top_ids[row, start:end, :wanted].tolist()  # [n, wanted]

        def text(token_id: int) -> str:
            return decode(tokenizer, [token_id])

        return [
            TokenLogprob(
                token_id, text(token_id), own[0], tuple((i, text(i), v) for i, v in zip(ids, own[1:], strict=True))
            )
            for token_id, own, ids in zip(tokens, values, top_ids, strict=True)
        ]
