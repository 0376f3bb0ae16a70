"""Stop strings: find the first one in a growing completion and cut the tokens before it."""

from __future__ import annotations


class StopChecker:
    """Fed each step's new tokens of one request; returns the kept tokens once a stop string appears.

    The completion must decode exactly from its tokens, so a stop string that begins inside a
    token ends the completion at the token boundary before it.
    """

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.longest = max(len(s) for s in stops)
        self.tokens: list[int] = []
        self.searched = 0  # characters of the text already searched

    def feed(self, new_tokens: list[int]) -> list[int] | None:
        if not new_tokens:
            return None
        self.tokens.extend(new_tokens)
        text = self._decode(self.tokens)
        start = max(0, self.searched - self.longest + 1)
        hits = [i for i in (text.find(stop, start) for stop in self.stops) if i >= 0]
        self.searched = len(text)
        if not hits:
            return None
        cut = min(hits)
        keep = len(self.tokens)
        while keep > 0:
            prefix = self._decode(self.tokens[:keep])
            if len(prefix) <= cut and text.startswith(prefix):
                break
            keep -= 1
        return self.tokens[:keep]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
