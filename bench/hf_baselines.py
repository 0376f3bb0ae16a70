"""The Hugging Face baselines of `specq bench`: batched `generate`, assisted generation and prompt lookup.

Both take the very token ids the engine gets (no second tokenization) and count tokens the way the
engine does: a completion is the generated tokens up to, not including, the first EOS. HF pads a
batch on the left before the prompts and, after a row's EOS, fills it with `pad_token_id` until the
whole batch stops; neither padding counts.

Assisted generation (Leviathan et al. 2023, as `generate(..., assistant_model=draft)`) refuses
batch_size > 1 in transformers 5.x, so it runs the prompts one by one; by default with HF's own
defaults for the assistant (20 candidate tokens, stopping early below 0.4 draft confidence).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel

    from specq.decoding.types import SamplingParams

# (prompts done, their completion tokens): called after each `generate` call of a pass, for its progress line
PromptsDone = Callable[[int, int], None]


def _unheard(done: int, tokens: int) -> None:
    """A pass nobody follows."""


@dataclass
class BaselineRun:
    """Completions by prompt index, the wall-clock seconds of the whole pass over the prompts, and where
    they went: the seconds of each `generate` call's first forward (its prompt's prefill; with prompt
    lookup, the first candidates verified with it) and the target's forwards after it (decode steps)."""

    outputs: dict[int, list[int]]
    seconds: float
    prefill_seconds: float = 0.0
    decode_forwards: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(tokens) for tokens in self.outputs.values())


class _ForwardClock:
    """The target's forwards during a pass, seen by module hooks (two clock reads a forward): the first of
    each `generate` call (`next_call`) is timed as its prefill, the rest are counted as decode steps."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.prefill_seconds = 0.0
        self.decode_forwards = 0
        self._first = True
        self._started = 0.0

    def __enter__(self) -> _ForwardClock:
        self._hooks = [
            self.model.register_forward_pre_hook(self._before),
            self.model.register_forward_hook(self._after),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()

    def next_call(self) -> None:
        self._first = True

    def _before(self, module: Any, args: Any) -> None:
        self._started = time.perf_counter()

    def _after(self, module: Any, args: Any, output: Any) -> None:
        if self._first:
            self.prefill_seconds += time.perf_counter() - self._started
            self._first = False
        else:
            self.decode_forwards += 1


def completion_tokens(generated: Sequence[int], eos_token_ids: Collection[int]) -> list[int]:
    """The completion in HF's generated ids: everything before the first EOS (the rest is padding)."""
    for i, token_id in enumerate(generated):
        if token_id in eos_token_ids:
            return list(generated[:i])
    return list(generated)


def generation_config(params: SamplingParams, pad_token_id: int, eos_token_ids: Collection[int]) -> GenerationConfig:
    """The HF settings that decode like the engine with `params` (their max_tokens and temperature):
    greedy where the engine is (`SamplingParams.greedy`), else plain sampling."""
    from transformers import GenerationConfig

    sampling: dict[str, Any] = (
        {"do_sample": False}
        if params.greedy
        else {"do_sample": True, "temperature": params.temperature, "top_k": 0, "top_p": 1.0}  # no cut, as the engine
    )
    return GenerationConfig(
        max_new_tokens=params.max_tokens,
        pad_token_id=pad_token_id,
        eos_token_id=sorted(eos_token_ids),
        **sampling,
    )


def batched_generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    batch_size: int,
    config: GenerationConfig,
    eos_token_ids: Collection[int],
    on_prompts: PromptsDone = _unheard,
) -> BaselineRun:
    """HF `generate` on the target alone, `batch_size` prompts at a time, left-padded (static batches:
    a batch ends when its slowest row does); `on_prompts` after each batch."""
    import torch

    from specq.decoding.packed_linear import plain_linears  # stock PyTorch linears: transformers as it runs

    device = next(model.parameters()).device
    pad = config.pad_token_id
    outputs: dict[int, list[int]] = {}
    started = time.perf_counter()
    with torch.inference_mode(), plain_linears(), _ForwardClock(model) as clock:
        for start in range(0, len(prompts), batch_size):
            clock.next_call()
            chunk = prompts[start : start + batch_size]
            width = max(len(p) for p in chunk)
            input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in chunk], device=device)  # [b, width]
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            sequences = model.generate(  # type: ignore[operator]
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config
            )  # [b, width + new]
            for row, generated in enumerate(sequences[:, width:].tolist()):
                outputs[start + row] = completion_tokens(generated, eos_token_ids)
            on_prompts(len(outputs), sum(map(len, outputs.values())))
    return BaselineRun(outputs, time.perf_counter() - started, clock.prefill_seconds, clock.decode_forwards)


def assisted_generate(
    model: PreTrainedModel,
    draft: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    eos_token_ids: Collection[int],
    assistant_tokens: int | None = None,
    on_prompts: PromptsDone = _unheard,
) -> BaselineRun:
    """HF assisted generation, one prompt at a time (its only batch size). `assistant_tokens` fixes
    the number of candidate tokens a step (schedule "constant"); None keeps HF's defaults."""
    with _assistant_tokens(draft, assistant_tokens):
        return _generate_one_at_a_time(model, prompts, config, eos_token_ids, on_prompts, assistant_model=draft)


def prompt_lookup_generate(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    eos_token_ids: Collection[int],
    lookup_tokens: int,
    on_prompts: PromptsDone = _unheard,
) -> BaselineRun:
    """HF prompt lookup decoding (`generate(prompt_lookup_num_tokens=N)`: candidates copied from the
    prompt's own n-grams, verified by the target), one prompt at a time (its only batch size)."""
    return _generate_one_at_a_time(
        model, prompts, config, eos_token_ids, on_prompts, prompt_lookup_num_tokens=lookup_tokens
    )


def _generate_one_at_a_time(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    eos_token_ids: Collection[int],
    on_prompts: PromptsDone,
    **speculation: Any,
) -> BaselineRun:
    """`generate` on each prompt alone (HF's speculative modes take batch size 1 only), `speculation`
    naming the mode's own keyword (`assistant_model=`, `prompt_lookup_num_tokens=`); `on_prompts` after each."""
    import torch

    from specq.decoding.packed_linear import plain_linears  # stock PyTorch linears: transformers as it runs

    device = next(model.parameters()).device
    outputs: dict[int, list[int]] = {}
    started = time.perf_counter()
    with torch.inference_mode(), plain_linears(), _quiet_transformers(), _ForwardClock(model) as clock:
        for i, prompt in enumerate(prompts):
            clock.next_call()
            input_ids = torch.tensor([list(prompt)], device=device)  # [1, prompt]
            sequence = model.generate(  # type: ignore[operator]
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                **speculation,
            )  # [1, prompt + new]
            outputs[i] = completion_tokens(sequence[0, len(prompt) :].tolist(), eos_token_ids)
            on_prompts(len(outputs), sum(map(len, outputs.values())))
    return BaselineRun(outputs, time.perf_counter() - started, clock.prefill_seconds, clock.decode_forwards)


def assistant_settings(draft: PreTrainedModel, assistant_tokens: int | None) -> dict[str, Any]:
    """The assistant settings HF will use (its global defaults fill what the draft's config leaves unset)."""
    defaults = draft.generation_config._get_default_generation_params()
    names = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    settings = {name: getattr(draft.generation_config, name, None) for name in names}
    settings = {name: defaults.get(name) if value is None else value for name, value in settings.items()}
    if assistant_tokens is not None:
        settings.update(num_assistant_tokens=assistant_tokens, num_assistant_tokens_schedule="constant")
    return settings


@contextlib.contextmanager
def _assistant_tokens(draft: PreTrainedModel, count: int | None) -> Iterator[None]:
    # HF reads the candidate count from the assistant's own generation config; set it for the call only.
    if count is None:
        yield
        return
    config = draft.generation_config
    saved = (config.num_assistant_tokens, config.num_assistant_tokens_schedule)
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = count, "constant"
    try:
        yield
    finally:
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = saved


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    # Assisted generation's own internal `generate` call trips a transformers deprecation warning.
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
