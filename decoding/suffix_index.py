"""A job-wide, bounded suffix index of token sequences (after SuffixDecoding, Oliaro et al. 2025).

SuffixDecoding keeps suffix trees over prompts and previous outputs and speculates along the most
frequent continuation of the current suffix, as far as the path's estimated probability stays high.
This index keeps the same statistics in a flatter form, for the job's finished outputs (a row's own
prompt is prompt lookup's, decoding/model_free.py): for every context of `min_context..max_context`
tokens seen in the sequences fed to it, how often each token followed. A proposal starts from the
longest context of the row's suffix that the index knows, repeatedly takes the most frequent next
token, and stops once the product of the taken tokens' frequencies (the path's confidence) falls
below `min_confidence`, so speculation is long where the job's outputs agree and short or none where
they do not.

Fed lazily: `add` only queues a sequence, and the queue is counted into the index at the next
proposal. A batch where speculation does not pay makes no proposals (the adaptive policy rests,
decoding/k_policy.py), and then pays nothing for the index either: counting takes about 23 ms per
1,000 tokens on the 2-core CPU (`benchmarks/suffix_index_memory.py`), so about 0.9 ms for a 32-token
output after its 8 context tokens, a tenth of a plain 16-row step of the demo target. The queue keeps
the `max_pending` latest sequences and drops older ones unread, so the first proposal after a long
rest counts a bounded backlog (tens of milliseconds) instead of stalling on a whole job's outputs.

Bounded: at most `max_contexts` contexts, the least recently fed evicted first; a full index
evicts and never fails. One context costs about `BYTES_PER_CONTEXT` bytes of Python objects (a
tuple of up to 8 ints and a small dict; measured by `benchmarks/suffix_index_memory.py` on the
demo tokenizer's ids of held-out stdlib sources: 558 bytes), so the default bound, 100,000
contexts, is about 56 MB per job.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

BYTES_PER_CONTEXT = 560  # measured (benchmarks/suffix_index_memory.py); the docs quote the figure


@dataclass(frozen=True)
class SuffixProposal:
    tokens: list[int]  # the most frequent continuation, possibly empty
    confidence: float  # the product of the proposed tokens' frequencies after their contexts


class SuffixIndex:
    def __init__(
        self,
        max_contexts: int = 100_000,
        min_context: int = 2,
        max_context: int = 8,
        min_confidence: float = 0.4,
        max_pending: int = 64,
    ) -> None:
        if max_contexts < 1 or not 1 <= min_context <= max_context or max_pending < 1:
            raise ValueError("need max_contexts >= 1, 1 <= min_context <= max_context and max_pending >= 1")
        self.max_contexts = max_contexts
        self.min_context, self.max_context = min_context, max_context
        self.min_confidence = min_confidence
        # context -> {next token: count}; ordered by last use, the least recent first
        self._followers: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()
        self._pending: deque[tuple[int, ...]] = deque(maxlen=max_pending)  # fed, not counted yet
        self._evictions = 0

    def __len__(self) -> int:
        self._count_pending()
        return len(self._followers)

    @property
    def evictions(self) -> int:
        self._count_pending()
        return self._evictions

    def add(self, tokens: Sequence[int]) -> None:
        """Feed `tokens`: every (context, next token) pair of it is counted before the next proposal."""
        self._pending.append(tuple(tokens))

    def _count_pending(self) -> None:
        while self._pending:
            self._count(self._pending.popleft())

    def _count(self, tokens: tuple[int, ...]) -> None:
        followers = self._followers  # a tuple's slice below is the context key itself: one allocation
        for end in range(self.min_context, len(tokens)):
            following = tokens[end]
            for n in range(self.min_context, min(self.max_context, end) + 1):
                context = tokens[end - n : end]
                counts = followers.get(context)
                if counts is None:
                    followers[context] = {following: 1}
                else:
                    counts[following] = counts.get(following, 0) + 1
                    followers.move_to_end(context)
        while len(followers) > self.max_contexts:
            followers.popitem(last=False)
            self._evictions += 1

    def propose(self, tokens: Sequence[int], limit: int) -> SuffixProposal:
        """Up to `limit` tokens continuing `tokens`, with the path's confidence."""
        self._count_pending()
        path: list[int] = list(tokens[-self.max_context :])
        proposed: list[int] = []
        confidence = 1.0
        longest = self.max_context
        while len(proposed) < limit:
            known = self._longest_known(path, longest)
            if known is None:
                break
            context_len, counts = known
            token, count = max(counts.items(), key=lambda item: item[1])
            step_confidence = confidence * count / sum(counts.values())
            if step_confidence < self.min_confidence:
                break
            confidence = step_confidence
            proposed.append(token)
            path.append(token)
            # a context of n + 2 tokens ending at the new token would mean one of n + 1 ending before it,
            # fed with it; so the search starts at n + 1 (eviction may have dropped a longer one: a
            # shorter context then proposes, which costs acceptance, never correctness)
            longest = context_len + 1
        return SuffixProposal(proposed, confidence if proposed else 0.0)

    def _longest_known(self, path: list[int], longest: int) -> tuple[int, dict[int, int]] | None:
        """The longest context of at most `longest` tokens ending `path` that the index knows, and its
        followers' counts."""
        for n in range(min(longest, self.max_context, len(path)), self.min_context - 1, -1):
            counts = self._followers.get(tuple(path[len(path) - n :]))
            if counts is not None:
                return n, counts
        return None
