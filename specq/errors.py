"""specq's domain exceptions, in one flat module. The CLI maps them to exit codes."""

import unicodedata


class SpecqError(Exception):
    """Base class: a failure with a message meant for the user."""


class BadInputError(SpecqError):
    """The input file has bad lines; `problems` holds one `INPUT:LINE: reason` string per bad line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class ConfigError(SpecqError):
    """A setting (an environment variable) has a bad value; the message names it."""


class OutputPathError(SpecqError):
    """The output path cannot be written (a missing folder, no permission, a folder): bad usage."""


class TimeLimitError(SpecqError):
    """`draft train --time-limit` too short for the smallest run the command can do (one training prompt,
    a little training and the held-out measurement): bad usage, refused before the target decodes."""


class ModelLoadError(SpecqError):
    """A model or tokenizer cannot be loaded, or the target and draft do not fit together."""


class ModelCompileError(ModelLoadError):
    """`--compile on`, and a model cannot be compiled (or its compiled forward differs from eager)."""


class ModelFetchError(SpecqError):
    """A catalogue model cannot be fetched here (pip, the network, a full disk, parts that do not assemble to
    the catalogue's file), or is not local where this process may not fetch it: the machine's failure, not
    the request's (exit 1; a worker gives its work back)."""


class ServiceUnavailableError(SpecqError):
    """Redis or the database cannot be reached."""


class FleetMismatchError(SpecqError):
    """The live workers on the broker serve another database than the job's: they would set its chunks
    aside unrun (a runtime failure, exit 1; nothing is stored)."""


class DatabaseUnreachableError(ServiceUnavailableError):
    """No connection to the database (refused, lost, timed out): it may come back, so readers wait."""


class DatabaseRefusedError(ServiceUnavailableError):
    """The database server answered and refused the connection for good (no such database, a wrong user or
    password, no access): waiting does not help, so nothing retries it."""


class DatabaseMissingError(DatabaseRefusedError):
    """The server has no database of that name (`specq db upgrade` creates it where the user may)."""


class SchemaError(SpecqError):
    """The database holds another revision of specq's schema: `specq db upgrade` migrates it."""


class JobNotFoundError(SpecqError):
    """No job has the given id."""


class JobActiveError(SpecqError):
    """The job is still running (or winding down) and the command needs it ended."""


class WorkerUnusableError(SpecqError):
    """This worker cannot serve (its device is unusable, or a model does not load on it): it exits with
    `exit_code` before (or instead of) failing any request, and its work goes to other workers."""

    def __init__(self, message: str, exit_code: int) -> None:
        self.exit_code = exit_code
        super().__init__(message)


# What a one-line message must not carry raw: control characters (a newline forges a line, ESC starts a
# terminal sequence), format characters (bidi overrides reorder what is shown), line and paragraph
# separators (str.splitlines breaks at them) and lone surrogates (no stream can encode them)
_UNPRINTABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def printable(text: str) -> str:
    """`text` fit for a one-line message: each character that could forge a line or drive a terminal written
    as its Python escape (`\\n`, `\\x1b`, `\\u202e`), everything else as it is. For text from files and
    templates the user did not write themselves."""
    return "".join(
        char.encode("unicode_escape").decode("ascii") if unicodedata.category(char) in _UNPRINTABLE else char
        for char in text
    )


def reason(exc: BaseException) -> str:
    """An exception in one line: Hugging Face errors run to several lines with hub advice, and the first
    line says what went wrong. Escaped (`printable`): a message may quote a model file's metadata."""
    lines = str(exc).strip().splitlines()
    first = printable(lines[0].strip()) if lines else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
