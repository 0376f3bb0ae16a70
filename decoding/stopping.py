"""Where a row ends: on EOS or max_tokens (`endings`, over the whole batch at once on the host copy of a
step's output) or on a stop string (`StopChecker`, per row, only for rows that watch for one).

Stop strings: find the first one in a growing completion and cut the tokens before it. Each step decodes
only the row's new tokens, with a few tokens before them as context (a SentencePiece tokenizer drops the
leading space of the first token it decodes, so the decode of a suffix is not always the suffix of the
decode), and searches a bounded tail of the text: the last `longest stop - 1` characters already
searched, so a stop string spanning steps is still found, plus the new text. A decode that ends inside a
multi-byte character ends in U+FFFD; those tokens stay in the window until the character completes. Only
when a stop string shows up is the whole completion decoded again, to cut it exactly where a full decode
would.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from specq.decoding.hf_model import Tokenizer, decode
from specq.decoding.types import FinishReason

RUNNING, FINISHED_STOP, FINISHED_LENGTH = 0, 1, 2  # a row after a step: going on, ended on EOS, on max_tokens

_CONTEXT_TOKENS = 4  # tokens decoded again before the new ones, for the tokenizers described above
_INCOMPLETE = "\ufffd"


class IncrementalText:
    """The text of a growing token list, decoded a few tokens at a time (the idea of text-generation-
    inference's and vLLM's incremental detokenizers)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.length = 0  # characters of committed text: the decode of tokens[:read_offset]
        self.prefix_offset = 0  # first token of the decoding window (context already in the text)
        self.read_offset = 0  # tokens whose text is committed

    def extend(self, new_tokens: list[int]) -> tuple[str, str]:
        """Add tokens; returns (newly committed text, pending text). Pending text belongs to tokens whose
        decode is not final yet (it ends inside a character); it is returned again, completed, later."""
        self.tokens.extend(new_tokens)
        window = decode(self.tokenizer, self.tokens[self.prefix_offset :])
        context = decode(self.tokenizer, self.tokens[self.prefix_offset : self.read_offset])
        if not window.startswith(context):
            # The context decodes differently on its own: fall back to the whole text this once.
            window = decode(self.tokenizer, self.tokens)
            context = decode(self.tokenizer, self.tokens[: self.read_offset])
        new_text = window[len(context) :]
        if new_text.endswith(_INCOMPLETE):
            return "", new_text
        self.length += len(new_text)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        return new_text, ""


class StopChecker:
    """Fed each step's new tokens of one request; returns the kept tokens once a stop string appears.

    The completion's text is cut exactly where the stop string begins (`cut_text`), as OpenAI and vLLM
    cut it; its tokens are those whose text begins before that point. So a stop string that begins
    inside a token keeps that token, whose text is then only partly in the completion (`"s\nimp"` on
    `import os\nimport` gives `"import o"`: the token `os` is kept, its `s` cut).
    """

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.longest = max(len(s) for s in stops)
        self.text = IncrementalText(tokenizer)
        self.tail = ""  # committed text from character `tail_start` on
        self.tail_start = 0
        self.searched = 0  # characters of the text already searched
        self.cut_text: str | None = None  # the completion's text once a stop string appeared

    @property
    def tokens(self) -> list[int]:
        return self.text.tokens

    def feed(self, new_tokens: list[int]) -> list[int] | None:
        if not new_tokens:
            return None
        committed, pending = self.text.extend(new_tokens)
        self.tail += committed
        text = self.tail + pending  # the completion's text from `tail_start` on
        start = max(0, self.searched - self.longest + 1)
        hit = any(text.find(stop, start - self.tail_start) >= 0 for stop in self.stops)
        self.searched = self.tail_start + len(text)
        # the next search starts at most `longest - 1` characters back; pending text is not kept
        drop = min(max(0, self.searched - self.longest + 1), self.text.length) - self.tail_start
        if drop > 0:
            self.tail, self.tail_start = self.tail[drop:], self.tail_start + drop
        return self._cut(start) if hit else None

    def _cut(self, start: int) -> list[int] | None:
        """The tokens before the first stop string at or after character `start` of the whole text."""
        text = decode(self.tokenizer, self.tokens)
        hits = [i for i in (text.find(stop, start) for stop in self.stops) if i >= 0]
        if not hits:
            return None
        cut = min(hits)
        keep = len(self.tokens)
        while keep > 0:
            prefix = decode(self.tokenizer, self.tokens[:keep])
            if len(prefix) <= cut and text.startswith(prefix):
                break
            keep -= 1
        if len(decode(self.tokenizer, self.tokens[:keep])) < cut:
            keep += 1  # the token the stop string begins in: its text before the stop string is kept
        self.cut_text = text[:cut]
        return self.tokens[:keep]


def endings(
    output_ids: np.ndarray, emitted: np.ndarray, room: np.ndarray, eos_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's kept tokens and ending after a step: row b appended the first `emitted[b]` of
    `output_ids` [rows, k + 1] (0: a row not appended to) and had `room[b]` tokens left before max_tokens;
    `eos_ids` [e >= 1] (-1 where none). Returns kept [rows] (up to the first EOS, or the room) and finish
    [rows]: RUNNING, FINISHED_STOP (EOS) or FINISHED_LENGTH. Small array operations on the host, where
    they cost far less than on the device."""
    width = output_ids.shape[1]
    appended = (emitted > 0).astype(np.int64)  # [rows] each row appended to gained 1 token or more
    is_eos = output_ids == eos_ids[0]  # [rows, k + 1]; one comparison per EOS id (np.isin: ~100 us)
    for eos in eos_ids[1:]:
        is_eos |= output_ids == eos
    is_eos &= np.arange(width) < emitted[:, None]
    first_eos = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1), width)  # [rows], width: none
    ends_on_eos = first_eos < np.minimum(emitted, room)
    kept = np.where(ends_on_eos, first_eos, np.minimum(emitted, room)) * appended
    finish = np.where(ends_on_eos, FINISHED_STOP, np.where(kept >= room, FINISHED_LENGTH, RUNNING)) * appended
    return kept, finish


class Watched(Protocol):
    """A row's request as `ended_rows` reads it (decoding.batch.Slot)."""

    stops: StopChecker | None


def ended_rows(
    live: np.ndarray,
    kept: np.ndarray,
    finish: np.ndarray,
    output_ids: np.ndarray,
    *,
    watching: np.ndarray,
    slots: Sequence[Watched | None],
) -> dict[int, tuple[FinishReason, list[int] | None]]:
    """The rows of `live` that ended this step (`kept`, `finish` [rows] from `endings`, `output_ids` [rows,
    k + 1] the step's output; `watching` [rows]: whether a row's request has stop strings, in `slots`):
    row -> (finish reason, its completion where a stop string cut it, else None). Only rows that ended or
    watch for stop strings are looked at; the rest stay vectorised."""
    ended: dict[int, tuple[FinishReason, list[int] | None]] = {}
    for row in live[(finish[live] != RUNNING) | watching[live]]:
        slot = slots[row]
        assert slot is not None
        if slot.stops is not None:
            cut = slot.stops.feed(output_ids[row, : kept[row]].tolist())
            if cut is not None:
                ended[int(row)] = ("stop", cut)
                continue
        if finish[row] != RUNNING:
            ended[int(row)] = ("stop" if finish[row] == FINISHED_STOP else "length", None)
    return ended
