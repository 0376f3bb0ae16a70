"""`specq submit`: validate the whole file, check the models, store the job, enqueue it (or run it here).

Order matters, so that a bad file or a bad model leaves nothing behind:

1. start the model check (tokenizers and configs: a missing model, a draft with another vocabulary,
   whether the target has a chat template; `jobs.model_check`), in a child process on the second core
   while this one reads the file, unless these model folders passed it before; an input that can be
   read only once (standard input, a pipe) is spooled to a temporary file (`jobs.input_source`);
2. reach the database and the broker: a service that is down fails now, before anything is written,
   and so does a broker whose live workers all serve another database (`jobs.fleet_registry`);
3. one transaction: the job row, then every request streamed from one read of the file (COPY on
   PostgreSQL). Chat lines are rendered to token ids on the way, each under a time and size bound,
   with the target's tokenizer loaded here at the first one (`jobs.chat_template`). Bad lines are
   collected while reading; if there was any, the transaction is rolled back and every bad line
   reported (chat lines too, when their template fails or outgrows its bounds, or when there is none):
   nothing stored, nothing enqueued. A failed model check stops the
   read as soon as it is known, and wins over bad lines; the transaction commits only after it passed;
4. enqueue one task per chunk; if the broker fails half way the job is deleted again.

One read, not two (validate, then store): parsing is most of the cost, and reading once while
PostgreSQL ingests the COPY stream on another core is what reaches 50,000+ lines/s. Memory stays flat
in the file's size: the read streams, and the duplicate-id check keeps 8 bytes a line.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field, replace
from datetime import timedelta

from sqlalchemy import delete
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from specq.db.migrate import open_migrated
from specq.db.models import Job
from specq.db.session import Database, identity
from specq.db.states import JobState
from specq.db.types import utcnow
from specq.errors import BadInputError, ServiceUnavailableError
from specq.jobs.chat_template import ChatLines
from specq.jobs.enqueue import enqueue_chunks, job_chunks
from specq.jobs.fleet_registry import check_fleet_serves
from specq.jobs.input_source import InputSource, readable_input
from specq.jobs.inputs import InputLimits, iter_request_specs
from specq.jobs.model_check import ModelCheck
from specq.jobs.services import check_broker
from specq.jobs.settings import JobSettings
from specq.jobs.store import insert_requests
from specq.queue import Chunk, QueueSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobSpec:
    """What to run: the models, the generation settings stored with the job, and its OpenAI Batch fields."""

    target: str
    draft: str | None
    settings: JobSettings = field(default_factory=JobSettings)  # its chunk size is decided when stored
    # `--chat-template`'s text: chat lines are rendered with it at submit; the job stores their token ids,
    # not the template (jobs.chat_template)
    chat_template: str | None = None
    served_model_name: str | None = None  # the `model` OpenAI-format export reports (jobs.export)
    metadata: dict[str, str] | None = None  # `--metadata` pairs, shown by status (OpenAI Batch's metadata)
    completion_window: str | None = None  # as given, e.g. "24h"; requests not started by then expire
    completion_window_s: float | None = None  # the same, in seconds


@dataclass(frozen=True)
class Submitted:
    job_id: str
    total: int
    chunks: list[Chunk]  # (job_id, first, end) of each chunk task
    db: Database
    embedded: bool  # True: no broker; the caller runs the chunks in this process (`worker.embedded`)


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


def submit_job(
    input_path: str,
    spec: JobSpec,
    *,
    database_url: str | None = None,
    broker: str | None = None,
    models_checked: bool = False,
    limits: InputLimits | None = None,
) -> Submitted:
    """Check, store (validating as it reads) and enqueue; see the module docstring. Raises
    ModelLoadError (whatever else failed), else ServiceUnavailableError or FleetMismatchError, else
    BadInputError (every bad line)."""
    with (
        ModelCheck(spec.target, spec.draft, skip=models_checked) as models,
        readable_input(input_path, limits) as source,
    ):
        db = open_migrated(database_url)
        if broker is not None:
            check_broker(broker)
            check_fleet_serves(broker, identity(db))
        job_id, total, chunk_size = _store(db, source, spec, broker, limits, models)
    log.info("job %s: stored %d requests from %s", job_id, total, source.name)

    chunks = list(job_chunks(job_id, total, chunk_size))
    if broker is not None:
        try:
            enqueue_chunks(broker, chunks, identity(db))
        except Exception:
            with db.session() as session:
                session.execute(delete(Job).where(Job.id == job_id))
            raise
    return Submitted(job_id, total, chunks, db, embedded=broker is None)


def _store(
    db: Database,
    source: InputSource,
    spec: JobSpec,
    broker: str | None,
    limits: InputLimits | None,
    models: ModelCheck,
) -> tuple[str, int, int]:
    """The job and its requests, in one transaction committed only if the file and the models are good;
    (job id, requests, chunk size)."""
    job_id = new_job_id()
    try:
        return _store_job(db, job_id, source, spec, broker, limits, models)
    except BadInputError:
        _reclaim_rolled_back(db)
        raise
    except OperationalError as exc:  # the store itself failed: a full disk, the server gone mid-write
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        raise ServiceUnavailableError(
            f"could not store the job in the database at {db.url} ({reason}; is its disk full?): nothing was stored"
        ) from None


def _reclaim_rolled_back(db: Database) -> None:
    """On PostgreSQL, vacuum the requests a rejected file's COPY wrote before its bad lines were known:
    rolled back, they stay on disk as dead rows (50 MB for 200,000 lines) until autovacuum comes by.
    VACUUM skips the pages that hold only live rows and gives the trailing dead ones back; best effort."""
    if db.is_sqlite:
        return  # its inserts rolled back with their pages
    try:
        with db.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM requests")
    except SQLAlchemyError as exc:
        log.warning("could not vacuum the rejected requests (%s); autovacuum will", exc)


def _store_job(
    db: Database,
    job_id: str,
    source: InputSource,
    spec: JobSpec,
    broker: str | None,
    limits: InputLimits | None,
    models: ModelCheck,
) -> tuple[str, int, int]:
    from specq.models.loading import load_tokenizer

    name = source.name
    # rolled back if the file has a bad line or the models are bad
    with ChatLines(spec.target, spec.chat_template, load_tokenizer) as chat_lines, db.session() as session:
        job = Job(
            id=job_id,
            state=JobState.QUEUED,
            target=spec.target,
            draft=spec.draft,
            input_name=name.encode("utf-8", "backslashreplace").decode(),  # a path need not be UTF-8
            served_model_name=spec.served_model_name,
            user_metadata=spec.metadata or None,
            completion_window=spec.completion_window,
            settings=spec.settings.to_stored(),
            total=0,
        )
        session.add(job)
        session.flush()
        # raises BadInputError, with every bad line, once the whole file is read
        specs = iter_request_specs(source.path, limits, name=source.name, prepare=chat_lines)
        total = insert_requests(session, job_id, models.watch(specs))
        if total == 0:
            raise BadInputError([f"{name}: the file has no requests"])
        training = spec.settings.draft_training
        if training is not None and training.prompts >= total:
            raise BadInputError(
                [
                    f"{name}: --draft {training.describe()} trains on the first {training.prompts} requests and "
                    f"speculates on the rest, but the file has {total}: give N below {total}"
                ]
            )
        models.wait()
        chunk_size = QueueSettings.from_env().chunk_size(total, spec.settings.decoding.batch_size)
        job.total, job.settings = total, replace(spec.settings, chunk_size=chunk_size).to_stored()
        if spec.completion_window_s is not None:  # the window opens when the job is stored and queued
            job.expires_at = utcnow() + timedelta(seconds=spec.completion_window_s)
        # set just before the enqueue: a sweeper treats a chunk as lost only once this is old
        job.enqueued_at = utcnow() if broker is not None else None
    return job_id, total, chunk_size
