"""What `run` and `submit` share: the generation options, the input limits, and the mapping of domain errors
to exits.

    @cli.command("run")
    @generation_options
    @input_limit_options
    def run(..., generation: GenerationOptions, input_limits: InputLimits):
        with specq_errors():
            ...

The ranges of the sampling and speculation options are specq.limits'. No torch here: `decoding` is
imported only when a command runs, so `specq --help` stays light.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from specq.durations import parse_duration
from specq.errors import (
    BadInputError,
    ConfigError,
    JobActiveError,
    JobNotFoundError,
    ModelLoadError,
    OutputPathError,
    SpecqError,
    TimeLimitError,
    WorkerUnusableError,
)
from specq.limits import (
    BATCH_SIZE,
    COMPILE_MODES,
    INPUT_BYTES,
    LINE_BYTES,
    MAX_TOKENS,
    MODEL_FREE,
    NUM_SPECULATIVE_TOKENS,
    SAMPLING_MODES,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    Limit,
)

if TYPE_CHECKING:
    from specq.decoding.config import DecodingConfig
    from specq.jobs.draft_training import DraftTraining
    from specq.jobs.patience import Patient
    from specq.jobs.settings import JobSettings

F = TypeVar("F", bound=Callable[..., Any])
Command = Callable[..., None]


class InputFile(click.Path):
    """INPUT.jsonl of `run` and `submit`: an existing file, or `-`. A missing one (or a folder) is bad input, not
    a misuse of the command line: one `Error:` line, exit 2, without the usage text that would not help."""

    def __init__(self) -> None:
        super().__init__(exists=True, dir_okay=False, allow_dash=True)

    def fail(self, message: str, param: click.Parameter | None = None, ctx: click.Context | None = None) -> NoReturn:
        raise UsageLine(click.BadParameter(message, ctx, param).format_message())


class Duration(click.ParamType):
    """A span of time as people write it (specq.durations): `90s`, `30m`, `24h`, `7d`, `2w`."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> timedelta:
        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


def int_range(limit: Limit) -> click.IntRange:
    """The click type of an integer option whose values are `limit`'s."""
    low, high = (None if end is None else int(end) for end in (limit.low, limit.high))
    return click.IntRange(low, high, min_open=limit.low_open, max_open=limit.high_open)


def float_range(limit: Limit) -> click.FloatRange:
    """The click type of a number option whose values are `limit`'s."""
    return click.FloatRange(limit.low, limit.high, min_open=limit.low_open, max_open=limit.high_open)


DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16")
GENERATION_PARAMS = (
    "target",
    "draft",
    "model_free",
    "num_speculative_tokens",
    "fixed_k",
    "sampling",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "batch_size",
    "device",
    "dtype",
    "chat_template",
    "served_model_name",
    "compile",
)


def compile_option(default: str, help: str) -> Callable[[F], F]:
    """`--compile auto|on|off`, as run, submit, worker and bench take it (decoding.compiled)."""
    return click.option("--compile", type=click.Choice(COMPILE_MODES), default=default, show_default=True, help=help)


_OPTIONS = [
    click.option(
        "--target",
        envvar="SPECQ_TARGET",
        callback=lambda ctx, param, value: _required_target(ctx, param, value),
        help="Target model: a Hugging Face id, a local folder, or a GGUF file (or a folder holding one; needs the "
        "gguf extra). [env: SPECQ_TARGET; required]",
    ),
    click.option(
        "--draft",
        envvar="SPECQ_DRAFT",
        help="Draft model sharing the target's tokenizer (as --target takes it), or a model-free proposer: "
        "'ngram' (prompt lookup) or "
        "'suffix' (the job's suffix index plus prompt lookup); with submit, 'train:N[:BUDGET]' trains a draft "
        "head on the job's first N completions and speculates with it for the rest; absent: plain decoding "
        "with the target. "
        "[env: SPECQ_DRAFT]",
    ),
    click.option(
        "--model-free",
        type=click.Choice(MODEL_FREE),
        help="With --draft MODEL: also this model-free proposer; each row takes, step by step, whichever "
        "proposal its measured acceptance says yields more (one verify pass for all).",
    ),
    click.option(
        "--num-speculative-tokens",
        "-k",
        type=int_range(NUM_SPECULATIVE_TOKENS),
        help="K: the most draft tokens a step may propose. [default: 4; 8 with a model-free proposer]",
    ),
    click.option(
        "--fixed-k",
        is_flag=True,
        help="Always propose K draft tokens, instead of choosing k <= K from measured step times.",
    ),
    click.option(
        "--sampling",
        type=click.Choice(SAMPLING_MODES, case_sensitive=False),
        help="exact: modified rejection sampling; reproducible: a seeded request's tokens are those the target "
        "alone samples with that seed, whatever the batch, k or draft. [default: reproducible]",
    ),
    click.option(
        "--max-tokens",
        type=int_range(MAX_TOKENS),
        help="New tokens per request, unless its line sets max_tokens. [default: 128]",
    ),
    click.option(
        "--temperature",
        type=float_range(TEMPERATURE),
        help="Sampling temperature, 0 for greedy, unless a line sets it. [default: 1.0]",
    ),
    click.option(
        "--top-p",
        type=float_range(TOP_P),
        help="Nucleus sampling mass, unless a line sets it. [default: 1.0]",
    ),
    click.option("--top-k", type=int_range(TOP_K), help="Top-k cut, 0 for none, unless a line sets it. [default: 0]"),
    click.option(
        "--seed",
        type=int_range(SEED),
        help="Sampling seed for requests whose line sets none. [default: a fresh one per request]",
    ),
    click.option("--batch-size", type=int_range(BATCH_SIZE), help="Sequences decoded together. [default: 8]"),
    click.option("--device", help="Torch device, e.g. cpu or cuda:0. [default: cuda:0 if available, else cpu]"),
    click.option(
        "--dtype",
        type=click.Choice(DTYPES, case_sensitive=False),
        help="Model weights' dtype; auto: bfloat16 on CUDA, on a CPU bfloat16 where the CPU has native bf16 and "
        "a one-time measurement shows it faster, else float32. [default: auto]",
    ),
    click.option(
        "--chat-template",
        type=click.Path(exists=True, dir_okay=False),
        help="A Jinja chat template file for chat lines, used instead of the tokenizer's own (needed when it has "
        "none); submit stores it with the job. [default: the target tokenizer's]",
    ),
    compile_option(
        "auto",
        "Compiled forwards (torch.compile, checked against eager at load): auto compiles on CUDA (with CUDA "
        "graphs), and on a CPU where a compile on this machine measured the model faster; on: where a model "
        "cannot be compiled, run exits 2 and a submitted job's requests fail with the reason (the workers "
        "compile); off never compiles.",
    ),
    click.option(
        "--served-model-name",
        help="The `model` that OpenAI-format output reports. [default: each line's body.model, else the target's "
        "name: a hub id as given, a local folder by its last component]",
    ),
]


def _required_target(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    # click's own "Missing option '--target'." does not say where a newcomer gets one
    if not value:
        raise click.MissingParameter(
            "Give a catalogue name (`specq models`), a Hugging Face id or a local folder, or set SPECQ_TARGET "
            '(`eval "$(specq demo-models)"` '
            "pulls the catalogue's Qwen2.5-Coder pair and sets target=... and draft=... to it)",
            ctx=ctx,
            param=param,
        )
    return value


def generation_options(command: Command) -> Command:
    """Add the generation options of the contract to a command, which gets them resolved as one keyword
    argument, `generation: GenerationOptions`."""

    @functools.wraps(command)
    def with_generation(*args: Any, **kwargs: Any) -> None:
        values = {name: kwargs.pop(name) for name in GENERATION_PARAMS}
        command(*args, generation=_resolve_generation(values), **kwargs)

    decorated: Command = with_generation
    for option in reversed(_OPTIONS):
        decorated = option(decorated)
    return decorated


@dataclass(frozen=True)
class GenerationOptions:
    """The resolved generation options; the fields are named as `jobs.local_run.run_file`'s keyword
    arguments."""

    target: str
    draft: str | None
    decoding: DecodingConfig
    sampling: dict[str, Any]  # the job-wide SamplingParams fields given (max_tokens, temperature, ...)
    device: str | None  # None: cuda:0 if available, else cpu
    dtype: str | None  # None: auto (models.loading.model_dtype)
    chat_template: str | None  # the text of --chat-template; None: the tokenizer's own
    served_model_name: str | None  # the `model` of OpenAI-format output; None: the line's, else the target's
    compile: str  # auto, on or off (decoding.compiled)
    # `--draft train:N`: the job trains its own draft head (jobs/draft_training.py); `submit` only
    draft_training: DraftTraining | None = None

    def job_settings(self, max_attempts: int) -> JobSettings:
        """The settings `submit` stores with the job (`jobs.settings`)."""
        from specq.jobs.settings import JobSettings

        return JobSettings(
            decoding=self.decoding,
            sampling=self.sampling,
            device=self.device,
            dtype=self.dtype,
            max_attempts=max_attempts,
            compile=self.compile,
            draft_training=self.draft_training,
        )


def _resolve_generation(values: dict[str, Any]) -> GenerationOptions:
    """The generation options from their parsed values (named as GENERATION_PARAMS, None where not given).

    A request's SamplingParams are then `jobs.params.sampling_params(generation.sampling, spec.overrides)`.
    """
    from specq.decoding.config import DecodingConfig
    from specq.decoding.types import SAMPLING_KEYS
    from specq.jobs.chat_template import load_chat_template

    decoding: dict[str, Any] = {"fixed_k": bool(values["fixed_k"])}
    if values["num_speculative_tokens"] is not None:
        decoding["num_speculative_tokens"] = values["num_speculative_tokens"]
    if values["batch_size"] is not None:
        decoding["batch_size"] = values["batch_size"]
    if values["sampling"] is not None:
        decoding["sampling"] = values["sampling"].lower()
    from specq.jobs.draft_training import DraftTraining

    try:
        training = DraftTraining.parse(values["draft"] or "")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--draft'") from None
    draft, model_free = _proposers(None if training else values["draft"] or None, values["model_free"])
    check_model_names(values["target"], draft)
    if model_free is not None:
        decoding["model_free"] = model_free
    try:
        config = DecodingConfig(**decoding)
        chat_template = None if values["chat_template"] is None else load_chat_template(values["chat_template"])
        if values["served_model_name"] and not values["served_model_name"].isprintable():
            raise ValueError("--served-model-name must be printable UTF-8 text")
    except (ValueError, ConfigError) as exc:
        raise click.UsageError(str(exc)) from None
    return GenerationOptions(
        target=values["target"],
        draft=draft,
        decoding=config,
        sampling={k: values[k] for k in SAMPLING_KEYS if values.get(k) is not None},  # no flag sets `stop`
        device=values["device"] or None,
        dtype=values["dtype"].lower() if values["dtype"] and values["dtype"].lower() != "auto" else None,
        chat_template=chat_template,
        served_model_name=values["served_model_name"] or None,
        compile=values["compile"],
        draft_training=training,
    )


def check_model_names(target: str, draft: str | None) -> None:
    """The model names checked before torch or transformers are imported (models/precheck.py): a typo, a
    missing path or an incomplete folder is one line in a second, not after the heavy imports."""
    from specq.models.precheck import check_model_name

    with specq_errors():
        check_model_name(target, "--target")
        if draft is not None:
            check_model_name(draft, "--draft")


def _proposers(draft: str | None, model_free: str | None) -> tuple[str | None, str | None]:
    """(draft model, model-free proposer) from --draft and --model-free."""
    if draft in MODEL_FREE:
        if model_free is not None:
            raise click.UsageError(f"--draft {draft} is model-free already; --model-free goes with --draft MODEL")
        return None, draft
    if draft is not None and "/" not in draft and not Path(draft).exists():
        # a bare word that is no folder and looks like a proposer's name is a typo, not a Hub id
        close = difflib.get_close_matches(draft.lower(), MODEL_FREE, n=1, cutoff=0.6)
        if close:
            raise click.BadParameter(
                f"{draft!r} is neither a model folder nor one of {', '.join(MODEL_FREE)} (did you mean {close[0]!r}?); "
                "choose a model (Hugging Face id or folder) or one of the model-free proposers",
                param_hint="'--draft'",
            )
    return draft, model_free


def input_limit_options(command: Command) -> Command:
    """Add --max-line-bytes and --max-input-bytes to a command, which gets them resolved as one keyword
    argument, `input_limits: jobs.inputs.InputLimits`."""

    @functools.wraps(command)
    def with_input_limits(*args: Any, max_line_bytes: int | None, max_input_bytes: int | None, **kwargs: Any) -> None:
        from specq.jobs.inputs import InputLimits

        command(*args, input_limits=InputLimits.from_env(max_line_bytes, max_input_bytes), **kwargs)

    decorated = click.option(
        "--max-input-bytes",
        type=int_range(INPUT_BYTES),
        envvar="SPECQ_MAX_INPUT_BYTES",
        help="Refuse an input file larger than this. [env: SPECQ_MAX_INPUT_BYTES; default: 4 GiB]",
    )(with_input_limits)
    return click.option(
        "--max-line-bytes",
        type=int_range(LINE_BYTES),
        envvar="SPECQ_MAX_LINE_BYTES",
        help="Report a line longer than this as bad input. [env: SPECQ_MAX_LINE_BYTES; default: 1 MiB]",
    )(decorated)


def _job_id(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.strip():  # `status ""` would list every job instead
        raise click.BadParameter("a job id must not be empty", ctx, param)
    return value


def job_argument(required: bool = True) -> Callable[[F], F]:
    """The JOB argument: a job id, never empty (a script's unset variable must not match every job)."""
    return click.argument("job", required=required, callback=_job_id)


def database_option(f: F) -> F:
    return click.option(
        "--database-url",
        envvar="SPECQ_DATABASE_URL",
        help="SQLAlchemy URL of the results store. [env: SPECQ_DATABASE_URL; default: an embedded SQLite file]",
    )(f)


def broker_option(f: F) -> F:
    return click.option(
        "--broker-url",
        envvar="SPECQ_BROKER_URL",
        help="Celery broker (Redis) URL. [env: SPECQ_BROKER_URL; default: none, work runs in-process]",
    )(f)


def patient_reads() -> Patient:
    """What a waiting or polling command reads the database through: it rides out an outage, with one
    warning line on stderr (jobs.patience)."""
    from specq.jobs.patience import Patient

    return Patient(lambda line: click.echo(line, err=True))


class BadInput(click.ClickException):
    """Bad input lines: each shown alone on its line as INPUT:LINE: reason, then a summary; exit 2."""

    exit_code = 2

    def __init__(self, problems: list[str]) -> None:
        super().__init__(f"{len(problems)} bad line{'s' if len(problems) != 1 else ''}; nothing was done")
        self.problems = problems

    def show(self, file: Any = None) -> None:
        for problem in self.problems:
            click.echo(problem, err=True)
        click.echo(f"Error: {self.format_message()}", err=True)


class UsageLine(click.ClickException):
    """A usage error about a value rather than the command line (a bad output path or setting, a job in
    a state that refuses the command): its one line, exit 2, without the usage text that would not help."""

    exit_code = 2


class WorkerExit(click.ClickException):
    """A worker that cannot serve: its one line, and the exit code that tells the autoscaler why."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]


@contextmanager
def specq_errors() -> Iterator[None]:
    """Turn domain errors into click's: bad input and unloadable models exit 2, services down exit 1,
    as one sentence without a traceback."""
    from specq.masking import mask_text

    try:
        yield
    except BadInputError as exc:
        raise BadInput(exc.problems) from None
    except (OutputPathError, ConfigError, JobActiveError, TimeLimitError) as exc:
        raise UsageLine(mask_text(str(exc))) from None
    except (ModelLoadError, JobNotFoundError) as exc:  # about a value, not the command line: no usage text
        raise UsageLine(mask_text(str(exc))) from None
    except WorkerUnusableError as exc:
        raise WorkerExit(mask_text(str(exc)), exc.exit_code) from None
    except SpecqError as exc:  # services down among them: a library's reason may quote a URL
        raise click.ClickException(mask_text(str(exc))) from None
