"""The ranges of the sampling and speculation settings, defined once.

Every check derives from these: `SamplingParams` and `DecodingConfig` (decoding/), the input-line checks
(jobs/inputs.py) and the CLI's click ranges (cli/options.py, cli/bench.py). Plain data: no torch, no click.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Limit:
    """A numeric range: `low` and `high` are its ends (None: unbounded), included unless `*_open`."""

    low: int | float | None = None
    high: int | float | None = None
    low_open: bool = False
    high_open: bool = False
    description: str = ""  # why the range is what it is

    def __contains__(self, value: int | float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def text(self) -> str:
        """How a message states the range: `in [0, 2]`, `in (0, 1]`, `>= 0`."""
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"

    def check(self, name: str, value: int | float) -> None:
        """Raise ValueError, naming `name`, if `value` is out of the range."""
        if value not in self:
            raise ValueError(f"{name} must be {self.text()}, got {value}")


MAX_TOKENS = Limit(1, 1_000_000, description="a sanity bound; the model's context is checked per request later")
TEMPERATURE = Limit(0, 2, description="OpenAI's range; 0 is greedy")
# The smallest temperature that samples: a positive one below it is decoded greedily, as 0 is (vLLM's
# _SAMPLING_EPS). Logits divided by 1e-40 overflow float32 (and 1e-300 is 0 there), so the softmax held
# NaNs and the sampler returned the last token of the vocabulary over and over; at 1e-5 the scaled
# logits stay finite and the distribution is already all but one-hot, so greedy is what the user meant.
MIN_SAMPLING_TEMPERATURE = 1e-5
TOP_P = Limit(0, 1, low_open=True, description="the nucleus' probability mass")
# A token id fits a signed 32-bit integer in every tokenizer; a larger k cuts nothing more (and 2**63
# overflowed the engine's int64 tensors)
TOP_K = Limit(0, 2**31 - 1, description="0: no top-k cut; at most the largest 32-bit vocabulary")
SEED = Limit(0, 2**63 - 1, description="a signed 64-bit integer")
MAX_STOP_STRINGS = 4  # as in the OpenAI API
COMPILE_MODES = ("auto", "on", "off")  # --compile: decoding.compiled
CHOICES = Limit(1, 128, description="`n`: completions of one line (OpenAI's most)")
LOGPROBS = Limit(0, 20, description="top log-probabilities a token, besides its own (OpenAI chat's most)")
COMPLETIONS_LOGPROBS = Limit(0, 5, description="/v1/completions' `logprobs` (OpenAI's most)")
NUM_SPECULATIVE_TOKENS = Limit(0, 32, description="K, the most draft tokens a step may propose; 0: no draft")
BATCH_SIZE = Limit(1, 65_536, description="sequences decoded together; a sanity bound far past any device's memory")
# exact: modified rejection sampling; reproducible: the coupled exponential race (decoding/sampling.py)
SAMPLING_MODES = ("exact", "reproducible")
# model-free proposers (decoding/model_free.py): prompt lookup; the job's suffix index plus prompt lookup
MODEL_FREE = ("ngram", "suffix")
# `specq bench` compares speculation with target-only decoding: it needs K >= 1
BENCH_SPECULATIVE_TOKENS = replace(NUM_SPECULATIVE_TOKENS, low=1, description="K of `specq bench`: at least 1")
# The input size limits (--max-line-bytes, --max-input-bytes): a line is read with readline(limit + 1),
# whose size must fit a signed 64-bit index; 1 TiB a line or 1 EiB a file is past any machine's memory
LINE_BYTES = Limit(1, 1 << 40, description="the longest input line read; past this a line is bad input")
INPUT_BYTES = Limit(1, 1 << 60, description="the largest input file read")
# A prompt given as token ids: each fits a signed 32-bit integer (the tokenizer's vocabulary is checked
# when the request is prepared)
TOKEN_ID = Limit(0, 2**31 - 1, description="a token id; the vocabulary's size is checked per request later")

# `specq bench --workloads W --drafts D` (bench/workloads.py, bench/draft_axis.py)
BENCH_CHAT_WORKLOADS = ("code-edit", "extract", "summarize", "qa")  # chat turns, for an instruct target
BENCH_WORKLOADS = ("continuation", "grounded", "templated", *BENCH_CHAT_WORKLOADS)
BENCH_DRAFTS = (
    "target_only",
    "draft",
    "ngram",
    "suffix",
    "hybrid",
    "hf_generate",
    "hf_assisted",
    "hf_prompt_lookup",
)

# Chat templates are user-controlled code (jobs/chat_render.py): `--chat-template` is read up to this size
# (the largest templates on the Hub are about 20 KiB), and each rendering runs in a child process under a
# time, a memory and an output bound. The time is a wall-clock bound on one line, generous for any real
# template (they render in milliseconds); SPECQ_CHAT_TEMPLATE_SECONDS sets another
CHAT_TEMPLATE_BYTES = 256 << 10
CHAT_TEMPLATE_SECONDS = Limit(0, 3600, low_open=True, description="the most one chat line's rendering may take")
DEFAULT_CHAT_TEMPLATE_SECONDS = 10.0
CHAT_RENDER_MEMORY_BYTES = 1 << 30  # the renderer's whole address space (its baseline is under 200 MiB)
RENDERED_PROMPT_CHARS = 4 << 20  # a rendered prompt: four 1 MiB lines' worth of text

# A GGUF file's header is walked against these before any reader builds it (models/gguf_header.py): gguf's
# reader makes Python objects for every tensor, key and array element a header declares, so three million
# declared tensors in 119 MB ran a machine out of memory. Each is far past any real model's
GGUF_TENSORS = 65_536  # tensor infos; the largest models hold a few thousand
GGUF_KEYS = 65_536  # metadata keys; real files hold under a hundred
# array elements of all keys together: a vocabulary's tokens, scores, types and merges come to under a
# million in the largest (Gemma 3's 262,144 tokens; Llama 3's 280,147 merges)
GGUF_ARRAY_ITEMS = 1 << 21
GGUF_ARRAY_DEPTH = 4  # arrays of arrays; real files nest none
GGUF_DIMENSIONS = 4  # a tensor's dimensions (ggml's GGML_MAX_DIMS)
