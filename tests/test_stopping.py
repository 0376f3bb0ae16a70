"""Stop strings, searched incrementally: the same cut as decoding the whole completion every step.

The reference below is that whole-text search (what the engine did before it decoded only new
tokens); every case feeds both the same tokens in the same steps and wants the same answer, for
tokenizers whose decode of a suffix is the suffix of the decode and for ones where it is not.
"""

from __future__ import annotations

import random

import pytest

from specq.decoding.stopping import IncrementalText, StopChecker
from tests.tiny_models import TINY_CORPUS, IdTokenizer


class _WholeTextStops:
    """The reference: decode the whole completion after every step, search what is new."""

    def __init__(self, tokenizer, stops: tuple[str, ...]):
        self.tokenizer, self.stops = tokenizer, stops
        self.longest = max(len(s) for s in stops)
        self.tokens: list[int] = []
        self.searched = 0

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def feed(self, new_tokens):
        if not new_tokens:
            return None
        self.tokens.extend(new_tokens)
        text = self._decode(self.tokens)
        start = max(0, self.searched - self.longest + 1)
        hits = [i for i in (text.find(stop, start) for stop in self.stops) if i >= 0]
        self.searched = len(text)
        if not hits:
            return None
        keep = len(self.tokens)
        while keep > 0:
            prefix = self._decode(self.tokens[:keep])
            if len(prefix) <= min(hits) and text.startswith(prefix):
                break
            keep -= 1
        if len(self._decode(self.tokens[:keep])) < min(hits):
            keep += 1  # the token the stop string begins in
        return self.tokens[:keep]


class _SentencePieceLike:
    """Pieces where "_" stands for a space, and decode drops the leading space of what it decodes, as
    Llama's SentencePiece tokenizer does: the decode of a suffix is not the suffix of the decode."""

    pieces = ("_the", "_cat", "s", "at", "_on", "_", "mat", ".", "_stop", "p", "_h", "ere", "!")

    def decode(self, ids, **_kwargs) -> str:
        text = "".join(self.pieces[i] for i in ids).replace("_", " ")
        return text[1:] if text.startswith(" ") else text


def _byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([TINY_CORPUS + "héllo wörld, naïve café 🙂 日本語"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.fixture(scope="module")
def byte_level():
    return _byte_level_tokenizer()


def _steps(tokens: list[int], rng: random.Random) -> list[list[int]]:
    """`tokens` cut into steps of 1 to 5 tokens, as a speculative step emits them."""
    out, i = [], 0
    while i < len(tokens):
        n = rng.randint(1, 5)
        out.append(tokens[i : i + n])
        i += n
    return out


def _same_as_whole_text(tokenizer, tokens: list[int], stops: tuple[str, ...], rng: random.Random) -> int | None:
    """Feed both checkers the same steps; returns the step that ended (None: none did)."""
    incremental, reference = StopChecker(tokenizer, stops), _WholeTextStops(tokenizer, stops)
    for step, new_tokens in enumerate(_steps(tokens, rng)):
        expected = reference.feed(new_tokens)
        assert incremental.feed(new_tokens) == expected, (step, new_tokens)
        if expected is not None:
            return step
    return None


def test_a_stop_string_spanning_tokens_and_steps():
    tokenizer = IdTokenizer()
    tokens = [3, 14, 15, 92, 65, 35, 89, 79]
    text = tokenizer.decode(tokens)
    for stop in ("15><92", "5><9", "<65><35><89", "2><6"):
        for steps in ([tokens], [[t] for t in tokens], [tokens[:3], tokens[3:5], tokens[5:]]):
            checker = StopChecker(tokenizer, (stop,))
            results = [checker.feed(s) for s in steps]
            cut = next(r for r in results if r is not None)
            # the text ends where the stop string begins; the tokens are those whose text begins before
            assert checker.cut_text == text[: text.index(stop)]
            kept = tokenizer.decode(cut)
            assert len(tokenizer.decode(cut[:-1])) < text.index(stop) <= len(kept)


@pytest.mark.parametrize("seed", range(20))
def test_same_cut_as_whole_text_search(seed):
    rng = random.Random(seed)
    tokenizer = IdTokenizer()
    tokens = [rng.randint(0, 12) for _ in range(rng.randint(1, 80))]
    text = tokenizer.decode(tokens)
    begin = rng.randrange(len(text))
    stops = (text[begin : begin + rng.randint(1, 12)], "<99>")  # one present, one absent
    assert _same_as_whole_text(tokenizer, tokens, stops, rng) is not None


@pytest.mark.parametrize("seed", range(20))
def test_a_tokenizer_whose_suffix_decodes_differently(seed):
    rng = random.Random(seed)
    tokenizer = _SentencePieceLike()
    tokens = [rng.randrange(len(tokenizer.pieces)) for _ in range(rng.randint(1, 60))]
    text = tokenizer.decode(tokens)
    begin = rng.randrange(max(1, len(text)))
    stops = (text[begin : begin + rng.randint(1, 6)] or "x", " stop here")
    _same_as_whole_text(tokenizer, tokens, stops, rng)


@pytest.mark.parametrize("seed", range(10))
def test_multi_byte_characters_split_across_tokens(byte_level, seed):
    rng = random.Random(seed)
    words = ["héllo", "wörld", "naïve", "café", "🙂", "日本語", "def", "add", "(a, b)", ":", "\n", " "]
    text = "".join(rng.choice(words) for _ in range(rng.randint(1, 40)))
    tokens = byte_level.encode(text, add_special_tokens=False)
    begin = rng.randrange(len(text))
    stops = (text[begin : begin + rng.randint(1, 4)], "never")
    assert _same_as_whole_text(byte_level, tokens, stops, rng) is not None


def test_incremental_text_equals_the_whole_decode(byte_level):
    rng = random.Random(0)
    text = "naïve café 🙂 " * 50
    tokens = byte_level.encode(text, add_special_tokens=False)
    incremental, pieces = IncrementalText(byte_level), []
    for step in _steps(tokens, rng):
        committed, _pending = incremental.extend(step)
        pieces.append(committed)
    assert "".join(pieces) == text and incremental.length == len(text)


def test_a_long_completion_decodes_each_token_a_bounded_number_of_times():
    """Whole-text decoding costs O(n^2) characters over a completion; incremental stays O(n)."""
    decoded: list[int] = []

    class Counting(IdTokenizer):
        def decode(self, ids, **kwargs) -> str:
            decoded.append(len(ids))
            return super().decode(ids, **kwargs)

    checker = StopChecker(Counting(), ("<1000>",))
    for token in range(2, 2002):
        assert checker.feed([token % 900]) is None
    assert sum(decoded) < 20 * 2000
    assert len(checker.tail) < 2 * len("<1000>")
