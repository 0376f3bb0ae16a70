"""specq's domain exceptions, in one flat module. The CLI maps them to exit codes."""


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


class ModelLoadError(SpecqError):
    """A model or tokenizer cannot be loaded, or the target and draft do not fit together."""


class ModelCompileError(ModelLoadError):
    """`--compile on`, and a model cannot be compiled (or its compiled forward differs from eager)."""


class ServiceUnavailableError(SpecqError):
    """Redis or the database cannot be reached."""


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


def reason(exc: BaseException) -> str:
    """An exception in one line: Hugging Face errors run to several lines with hub advice, and the first
    line says what went wrong."""
    lines = str(exc).strip().splitlines()
    first = lines[0].strip() if lines else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
