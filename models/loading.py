"""Loading the target and draft models and their tokenizer, and turning requests into token ids.

Loading is pure: every call reads from disk (or the Hugging Face cache) again. Keeping models alive
between jobs is the worker's business, with a cache it can bound.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from specq.errors import ModelLoadError, reason
from specq.models import gguf, names
from specq.models.families import attention_implementation, why_unsupported

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specq.decoding.compiled import CompileOutcome, FirstForwards

logger = logging.getLogger(__name__)

# Accepted spellings of --dtype, mapped to torch attribute names.
_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def resolve_device(device: str | None) -> str:
    """The torch device for --device; None means the first GPU if there is one, else the CPU."""
    import torch

    return device or ("cuda:0" if torch.cuda.is_available() else "cpu")


AUTO = "auto"  # --dtype auto (or none given): bf16 on CUDA; on a CPU, models/cpu_dtype.py's choice per model


def resolve_dtype(dtype: str | None, device: str) -> torch.dtype:
    """The torch dtype for a --dtype spelling; `auto` (or None) means bf16 on CUDA and fp32 elsewhere,
    before a model is known: `load_model` asks models/cpu_dtype.py for a CPU's choice for its model."""
    import torch

    if dtype is None or dtype.lower() == AUTO:
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    name = _DTYPE_NAMES.get(dtype.lower())
    if name is None:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {', '.join([AUTO, *_DTYPE_NAMES])}")
    return getattr(torch, name)


def conversion_dtype(dtype: str | None, device: str) -> str | None:
    """The dtype (a torch dtype's name) a GGUF file is converted in for a load in `dtype` on `device`, where
    it is known before the model's config is read: a tokenizer or config read from the conversion the
    weights will load from converts the file once, not once more in fp32; None for `auto` on a CPU."""
    if (dtype is None or dtype.lower() == AUTO) and str(device) == "cpu":
        return None
    return str(resolve_dtype(dtype, device)).removeprefix("torch.")


def model_dtype(name_or_path: str, config: Any, device: str, dtype: str | None) -> torch.dtype:
    """The dtype a model loads in: --dtype's; with `auto` (or None) on a CPU, bf16 where the CPU has native
    bf16 and a one-time measurement of this model shows it faster, else fp32 (models/cpu_dtype.py)."""
    import torch

    from specq.models import cpu_dtype

    if (dtype is not None and dtype.lower() != AUTO) or str(device) != "cpu":
        return resolve_dtype(dtype, device)

    def measure() -> Any:
        logger.info("--dtype auto: measuring %s in bf16 against fp32 on this CPU (once)", name_or_path)
        return cpu_dtype.measure_bf16_speedup(_read_weights(name_or_path, config, torch.float32))

    choice = cpu_dtype.choose(config, measure)
    logger.info("--dtype auto on cpu: %s for %s (%s)", choice.dtype, name_or_path, choice.why)
    return cast("torch.dtype", getattr(torch, choice.dtype))


def model_folder(name_or_path: str, dtype: str | None = None) -> str:
    """What transformers loads for a model name, for `run`, `submit`, the workers, `bench` and `draft train`
    alike: a catalogue name's GGUF file (fetched first where it is not local, models/names.py), and any
    GGUF file, as its converted folder in `dtype` (a torch dtype's name; None: any there is, models/gguf.py;
    converted on first use); else the name unchanged."""
    return gguf.resolve(names.resolve(name_or_path), dtype)


def check_location(name_or_path: str) -> None:
    """ModelLoadError, one line, when nothing exists at `name_or_path` and it cannot be a Hugging Face id
    either (a mistyped folder such as `./models/draft`): transformers would answer with hub advice about
    repo ids, which does not say that the folder is missing."""
    from pathlib import Path

    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(name_or_path).expanduser().exists():
        return
    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        raise ModelLoadError(
            f"no folder exists at {name_or_path!r}, and it is not a Hugging Face id (NAME or OWNER/NAME) either"
        ) from None


def load_tokenizer(name_or_path: str, converted: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a Hugging Face id, a local folder or a GGUF file (read from its conversion in
    `converted`, models/gguf.py); ModelLoadError if it cannot be loaded."""
    from transformers import AutoTokenizer

    folder = model_folder(name_or_path, converted)  # first: a missing .gguf file is named as one
    check_location(name_or_path)
    logger.info("loading tokenizer %s", name_or_path)
    try:
        return AutoTokenizer.from_pretrained(folder)
    # from_pretrained fails in many ways (OSError, ValueError, KeyError, JSON errors); all mean the same.
    except Exception as exc:
        where = gguf.described(name_or_path, folder)
        raise ModelLoadError(f"cannot load the tokenizer of {where} ({reason(exc)})") from exc


def load_config(name_or_path: str, converted: str | None = None) -> Any:
    """The model config of a Hugging Face id, a local folder or a GGUF file (read from its conversion in
    `converted`); ModelLoadError if it cannot be loaded."""
    from transformers import AutoConfig

    folder = model_folder(name_or_path, converted)
    check_location(name_or_path)
    try:
        return AutoConfig.from_pretrained(folder)
    except Exception as exc:
        where = gguf.described(name_or_path, folder)
        raise ModelLoadError(f"cannot load the model config of {where} ({reason(exc)})") from exc


def check_supported(name_or_path: str, config: Any) -> None:
    """ModelLoadError, one line naming the family and why, unless specq decodes this model exactly."""
    reason = why_unsupported(config)
    if reason is not None:
        raise ModelLoadError(f"the model {name_or_path!r}: {reason}")


def load_model(name_or_path: str, device: str = "cpu", dtype: str | None = None) -> PreTrainedModel:
    """A causal LM in eval mode on `device`, in `dtype` (`model_dtype`), with SDPA attention where its
    family supports it, else eager; ModelLoadError if it cannot be loaded or its family is not supported
    (models/families.py)."""
    config = load_config(name_or_path, conversion_dtype(dtype, device))
    check_supported(name_or_path, config)
    torch_dtype = model_dtype(name_or_path, config, device, dtype)
    logger.info("loading model %s on %s as %s", name_or_path, device, torch_dtype)
    model: Any = _read_weights(name_or_path, config, torch_dtype)
    try:
        model = model.to(device)
    except Exception as exc:
        where = gguf.described(name_or_path, model_folder(name_or_path, str(torch_dtype).removeprefix("torch.")))
        raise ModelLoadError(f"cannot load the model {where} ({reason(exc)})") from exc
    return cast("PreTrainedModel", model.eval())


def _read_weights(name_or_path: str, config: Any, torch_dtype: torch.dtype) -> Any:
    """The model's weights in `torch_dtype`, on the CPU; a GGUF file's from its conversion in that dtype."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    folder = model_folder(name_or_path, str(torch_dtype).removeprefix("torch."))
    # transformers' own per-tensor bar would interleave with specq's progress bar on stderr
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        # transformers 5 takes `dtype=`; `torch_dtype=` is deprecated there.
        # Any: mypy cannot follow the decorator transformers wraps `to` in.
        return AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtype, attn_implementation=attention_implementation(config)
        )
    except Exception as exc:
        where = gguf.described(name_or_path, folder)
        raise ModelLoadError(f"cannot load the model {where} ({reason(exc)})") from exc
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


@dataclass
class ModelPair:
    """The target, the optional draft, and the one tokenizer they share."""

    target: PreTrainedModel
    draft: PreTrainedModel | None  # or a draft head on the target (decoding/draft_head.py), loaded as Any
    tokenizer: PreTrainedTokenizerBase
    target_name: str
    draft_name: str | None
    # role ("target", "draft") -> what `--compile` did with it (decoding.compiled); empty with `off`
    compiled: dict[str, CompileOutcome] = field(default_factory=dict)
    warm_up_s: float = 0.0  # decoding requests through the compiled models at load, where asked (decoding.compiled)
    compile_mode: str = "off"  # `--compile` as the load was asked it
    # role -> the forwards its load compiled and checked (decoding.compiled.FirstForwards), which a later
    # measurement of its speedup times
    first_forwards: dict[str, FirstForwards] = field(default_factory=dict)

    @property
    def dtype(self) -> str:
        """The dtype the target runs in (`--dtype auto`'s choice where it chose), as torch names it."""
        return str(next(self.target.parameters()).dtype).removeprefix("torch.")

    def measure_compiled_speedups(self) -> str | None:
        """Measure each compiled model's decode step against eager where this machine keeps no measurement
        for it (decoding/compile_speedups.py: once per model and machine, for later `auto` loads): for a
        caller whose load did not (`load_pair(measure_at_load=False)`), after its first tokens. The line
        saying what was measured, or None where nothing was."""
        from dataclasses import replace

        from specq.decoding.compiled import measure_compiled_speedup

        models = {"target": self.target, "draft": self.draft}
        names = {"target": self.target_name, "draft": self.draft_name}
        measured = []
        for role, outcome in self.compiled.items():
            if not outcome.compiled or outcome.speedup is not None or role not in self.first_forwards:
                continue
            started = time.perf_counter()
            try:
                measurement = measure_compiled_speedup(models[role], names[role] or role, self.first_forwards[role])
            except Exception as exc:  # the run is done: a failed measurement costs the record, not the run
                logger.warning("cannot measure the compiled %s: %s", role, reason(exc))
                continue
            if measurement is None:
                continue
            seconds = time.perf_counter() - started
            self.compiled[role] = replace(
                outcome, speedup=measurement.median, measured_s=seconds, measurement=measurement.describe()
            )
            measured.append(f"{role}: a decode step {measurement.describe()} ({seconds:.1f}s)")
        if not measured:
            return None
        return "--compile: measured for later --compile auto loads, " + "; ".join(measured)

    def compile_report(self) -> dict[str, Any] | None:
        """What `--compile` did with each model (role -> its name, whether it runs compiled, the seconds
        it took, the decode-step speedup it measured, why it runs eagerly) and the warm-up decode's
        seconds, as JSON; None with `off`."""
        if not self.compiled:
            return None
        names = {"target": self.target_name, "draft": self.draft_name}
        report: dict[str, Any] = {
            role: {
                "model": names[role],
                "compiled": outcome.compiled,
                "seconds": round(outcome.seconds, 2),
                "speedup": None if outcome.speedup is None else round(outcome.speedup, 3),
                "reason": outcome.reason,
                "graphs": outcome.graphs,
                "cached_graphs": outcome.cached_graphs,
            }
            for role, outcome in self.compiled.items()
        }
        report["warm_up_s"] = round(self.warm_up_s, 2)
        return report

    def compile_line(self) -> str | None:
        """The start-up line of `--compile`: what each model compiled at load, from the cache or not, in how
        long, and why it runs as it does; None with `off`, and with `auto` where nothing compiled (the
        default's quiet choice: nothing the user asked for, nothing that changed)."""
        if not self.compiled:
            return None
        if self.compile_mode == "auto" and not any(outcome.compiled for outcome in self.compiled.values()):
            return None
        parts = [f"{role}: {outcome.summary()}" for role, outcome in self.compiled.items()]
        if self.warm_up_s:
            parts.append(f"a warm-up decode {self.warm_up_s:.1f}s")
        elif any(outcome.compiled for outcome in self.compiled.values()):
            parts.append("other shapes compile when a job first takes them")
        return "--compile: " + "; ".join(parts)


def check_same_vocab(
    target_tokenizer: PreTrainedTokenizerBase,
    draft_tokenizer: PreTrainedTokenizerBase,
    target_name: str,
    draft_name: str,
) -> None:
    """ModelLoadError unless both tokenizers map the same strings to the same ids.

    The models' `config.vocab_size` may still differ (embedding tables padded to a multiple of 64 or
    128); the engine compares logits over the tokenizer's ids only.
    """
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differing = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
    raise ModelLoadError(
        f"the draft {draft_name!r} does not share the vocabulary of the target {target_name!r} "
        f"({len(draft_vocab)} vs {len(target_vocab)} tokens, {differing} entries differ)"
    )


def target_shape(config: Any) -> tuple[int, int]:
    """(hidden size, vocabulary size) of a target's model config: what a draft head must match."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.hidden_size), int(text.vocab_size)


def check_pair(target: str, draft: str | None, converted: str | None = None) -> PreTrainedTokenizerBase:
    """Everything a load of the pair checks before any model weights are read, for `run`, `submit` and
    the workers alike: the target's tokenizer (returned) and config, the family's support, the draft's
    vocabulary, and a draft head (a folder `specq draft train --proposer head` wrote, decoding/draft_head.py)
    against the target's shape, every field of it; any other draft's config and family. ModelLoadError,
    one line."""
    from specq.decoding.draft_head import is_head_folder, read_head

    tokenizer = load_tokenizer(target, converted)
    target_config = load_config(target, converted)
    check_supported(target, target_config)
    if draft is None:
        return tokenizer
    check_same_vocab(tokenizer, load_tokenizer(draft, converted), target, draft)
    if not is_head_folder(draft):
        check_supported(draft, load_config(draft, converted))
        return tokenizer
    try:
        read_head(draft, *target_shape(target_config))
    except ValueError as exc:
        raise ModelLoadError(f"cannot load the draft {draft!r}: {exc}") from None
    return tokenizer


def pack_for_verifies(model: Any) -> None:
    """The model's linear layers packed for multi-token forwards where that pays (decoding/packed_linear.py:
    fp32 on a CPU, where a verify of K + 1 tokens then costs about one and a half steps, not four)."""
    from specq.decoding.packed_linear import can_pack, choose_one_row_kernels, pack_linears

    parameter = next(model.parameters())
    if not can_pack(parameter.device, parameter.dtype):
        return
    weights = sum(p.nbytes for p in model.parameters())
    if weights > _available_memory() // 2:  # the packed copy costs the weights again: leave room beside it
        logger.info("linear layers left unpacked: %d MB of weights, too little free memory", weights >> 20)
        return
    packed = pack_linears(model)
    logger.info("packed %d linear layers (%d read it for one token too)", packed, choose_one_row_kernels(model))


def _available_memory() -> int:
    """Bytes the kernel can give new allocations without swapping (Linux's MemAvailable, page cache
    included: the weights just read sit there); elsewhere unknown, taken as enough."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 1 << 62


def load_pair(
    target: str,
    draft: str | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    compile: str = "off",
    warm_up: bool = False,
    first_rows: int = 1,
    measure_at_load: bool = True,
) -> ModelPair:
    """Load the target, the draft and the target's tokenizer; fail early if they do not fit together.

    Configs (the family's support) and tokenizers are checked before any weights are read, so an
    unsupported or mismatched pair costs seconds, not minutes. `compile` (auto, on, off): the models'
    forwards compiled as decoding.compiled says (ModelCompileError with `on` where one cannot be): what
    every job runs first at load, the rest when a job first takes it; `warm_up`: every kind of graph a
    job may take at load instead, for a caller that times its first steps; `first_rows`: the rows of a
    job's first forwards (its batch size, or fewer requests), where the caller knows them;
    `measure_at_load`: a compiled model's speedup, where this machine has none kept for it, is measured
    at load (for a benchmark, before its clock), else by the caller after its first tokens
    (`ModelPair.measure_compiled_speedups`).
    """
    from specq.decoding.draft_head import is_head_folder, load_head
    from specq.decoding.hf_model import HiddenTap

    tokenizer = check_pair(target, draft, conversion_dtype(dtype, device))
    # a draft head (`specq draft train --proposer head`) is a folder of its own kind, loaded onto the target
    head = draft is not None and is_head_folder(draft)
    target_model = load_model(target, device, dtype)
    # before a head or the tap hooks the target's layers: the packed ones are the ones they see
    pack = compile != "on"  # compiled graphs take plain linears; `auto` compiles on a CPU only where measured
    if pack:
        pack_for_verifies(target_model)
    draft_model: Any = None
    if head:
        assert draft is not None
        try:
            draft_model = load_head(draft, target_model)
        except ValueError as exc:
            raise ModelLoadError(f"cannot load the draft {draft!r}: {exc}") from None
    elif draft is not None:
        draft_model = load_model(draft, device, dtype)
        if pack:
            pack_for_verifies(draft_model)
    for name, model in ((target, target_model), (None if head else draft, draft_model)):
        if name is not None and model is not None and model.config.vocab_size < len(tokenizer):
            raise ModelLoadError(
                f"the model {name!r} has {model.config.vocab_size} output logits, fewer than the "
                f"{len(tokenizer)} tokens of its tokenizer"
            )
    pair = ModelPair(target=target_model, draft=draft_model, tokenizer=tokenizer, target_name=target, draft_name=draft)
    # a draft head reads the target's hidden states through a hook on its LM head, which a compile traces
    # only if it is there first: on every target, for a head loaded now or trained later by its job
    HiddenTap.install(target_model)
    pair.compile_mode = compile
    if compile != "off":
        from specq.decoding.compiled import FirstForwards, compile_model, warm_up_decoding

        def compiled_role(role: str, model: PreTrainedModel, name: str, first: FirstForwards) -> Any:
            pair.first_forwards[role] = first
            model, pair.compiled[role] = compile_model(
                model,  # type: ignore[arg-type]
                name,
                compile,  # type: ignore[arg-type]
                first=first,
                measure_at_load=measure_at_load,
            )
            return model

        # what a job runs first: the target verifies k + 1 tokens behind a draft model, one alone
        widths = (2,) if draft_model is not None else (1,)
        pair.target = compiled_role("target", target_model, target, FirstForwards(first_rows, widths=widths))
        if draft_model is not None and draft is not None and not head:  # a head's steps are too small to gain
            first = FirstForwards(first_rows, widths=(1,))
            pair.draft = compiled_role("draft", draft_model, draft, first)
        if warm_up and any(outcome.compiled for outcome in pair.compiled.values()):
            pair.warm_up_s = warm_up_decoding(pair.target, pair.draft, tokenizer)
            logger.info("decoded a warm-up through the compiled models in %.1fs", pair.warm_up_s)
        logger.info("%s", pair.compile_line() or "--compile auto: the models run eagerly")
    return pair


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def tokenize_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """Token ids of a plain prompt (with the tokenizer's usual special tokens, e.g. BOS) or of chat
    messages rendered with `chat_template` (a Jinja template; default: the tokenizer's own) and an open
    assistant turn."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    if prompt is not None:
        return [int(i) for i in tokenizer(prompt)["input_ids"]]
    if chat_template is None and not has_chat_template(tokenizer):
        raise ModelLoadError(
            f"the tokenizer of {tokenizer.name_or_path!r} has no chat template, so chat messages "
            "cannot be rendered; give one with --chat-template FILE, or send a plain prompt"
        )
    assert messages is not None
    # transformers 5 returns a BatchEncoding unless return_dict=False; accept either shape.
    ids: Any = tokenizer.apply_chat_template(
        cast(list[dict[str, str]], messages),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        chat_template=chat_template,
    )
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(i) for i in ids]
