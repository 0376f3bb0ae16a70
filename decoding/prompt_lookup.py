"""Prompt lookup (Saxena 2023, "prompt lookup decoding"; vLLM's `ngram` method), one row at a time.

The row's longest suffix of `min_match..max_match` tokens that occurred earlier in the row (prompt
and output so far) proposes the tokens that followed its most recent earlier occurrence. Where that
copy reaches the end of the sequence, it goes on copying what it just proposed (an overlapping copy,
as LZ77 decodes one): a row repeating a period of p tokens matches p tokens back, and would otherwise
be offered only p tokens a step however long the repetition runs. Lookups are
O(max_match) dictionary probes: each n-gram's latest end is recorded, instead of rescanning the
sequence every step. Recording is lazy: tokens are only appended as they arrive and indexed at the
next lookup, so a row costs next to nothing while the engine makes no offers (the adaptive policy
rests where speculation does not pay, decoding/k_policy.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RowLookup:
    """One row's sequence and, per n-gram (n in [min_match, max_match]) that has a continuation, where
    its latest continuation starts (for the tokens before `indexed`)."""

    min_match: int
    max_match: int
    prompt_len: int = 0
    tokens: list[int] = field(default_factory=list)
    continuation_at: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # tokens[:indexed] are continuations the index records

    def extend(self, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)

    def _catch_up(self) -> None:
        """Every n-gram that has a following token points at it."""
        tokens, continuation_at = self.tokens, self.continuation_at
        for end in range(max(self.indexed, self.min_match), len(tokens)):
            for n in range(self.min_match, min(self.max_match, end) + 1):
                continuation_at[tuple(tokens[end - n : end])] = end
        self.indexed = len(tokens)

    def propose(self, limit: int) -> tuple[list[int], int]:
        """Up to `limit` tokens that followed the longest earlier match of the row's suffix, and that
        match's length (0 and no tokens: no suffix of min_match tokens occurred before)."""
        self._catch_up()
        tokens = self.tokens
        for n in range(min(self.max_match, len(tokens)), self.min_match - 1, -1):
            start = self.continuation_at.get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                proposal = tokens[start : start + limit]
                period = len(tokens) - start  # the copy's distance back: past the end it repeats itself
                while len(proposal) < limit:
                    proposal.append(proposal[len(proposal) - period])
                return proposal, n
        return [], 0
