"""A job's resolved generation settings, as one type at both ends (arq's JobDef): `submit` builds it, the
store keeps its JSON form (the `jobs.settings` column), and workers, sweepers, `retry` and `status` read
that form back through `JobSettings.from_stored`, never by key.

The stored form is the one every version wrote: `{"decoding": DecodingConfig's fields, "sampling": the
job's default sampling settings, "device", "dtype", "chunk_size", "max_attempts", "compile"}`, with
"draft_training" where the job trains its draft; a row an older version stored lacks the newer keys and
reads with their defaults, and keys a newer version added are ignored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from specq.decoding.config import DecodingConfig
from specq.jobs.draft_training import DraftTraining
from specq.queue import DEFAULT_MAX_ATTEMPTS


@dataclass(frozen=True)
class JobSettings:
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    # the job's default sampling settings, only those given (SamplingParams' field names); a line's own
    # settings win over them (`jobs.params.sampling_params`)
    sampling: dict[str, Any] = field(default_factory=dict)
    device: str | None = None  # for the in-process run; queue workers use their own device
    dtype: str | None = None  # None: the device's default (models.loading)
    # requests a chunk task covers; 0 while the job is being stored, before its requests are counted
    chunk_size: int = 0
    # a request whose worker died this many times while running it fails instead of running again
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    compile: str = "auto"  # --compile: workers compile the models as it says (auto: their own choice)
    # the chat template of a job stored before chat lines were rendered at submit (jobs.chat_template);
    # newer jobs store token ids and leave it None, and it is then not written
    chat_template: str | None = None
    # `--draft train:N`: the job trains its own draft head (jobs/draft_training.py); None, and then not
    # written, for every other job
    draft_training: DraftTraining | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")

    def to_stored(self) -> dict[str, Any]:
        """The JSON form the store keeps."""
        stored = {f.name: getattr(self, f.name) for f in fields(self)}
        stored["decoding"] = self.decoding.to_dict()
        if self.chat_template is None:
            del stored["chat_template"]
        if self.draft_training is None:
            del stored["draft_training"]
        else:
            stored["draft_training"] = asdict(self.draft_training)
        return stored

    @classmethod
    def from_stored(cls, stored: dict[str, Any]) -> JobSettings:
        """The settings from their JSON form, whichever version wrote it: a missing key (or a null
        `max_attempts`, as early rows hold) takes its default, an unknown one is ignored."""
        known = {f.name for f in fields(cls)}
        given = {name: value for name, value in stored.items() if name in known}
        given["decoding"] = _decoding_config(stored.get("decoding") or {})
        if given.get("draft_training") is not None:
            given["draft_training"] = DraftTraining(**given["draft_training"])
        if not given.get("max_attempts"):
            given.pop("max_attempts", None)
        return cls(**given)


def _decoding_config(stored: dict[str, Any]) -> DecodingConfig:
    known = DecodingConfig.__dataclass_fields__.keys()
    return DecodingConfig(**{name: value for name, value in stored.items() if name in known})
