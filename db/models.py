"""The results store: jobs, their requests and results, per-batch metrics, live workers.

Raw counters only (tokens, drafts, seconds); rates are derived where they are read (`jobs.status`).
Relationships are `lazy="raise"`, so every query is written out where it runs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from specq.db.states import JobState, RequestState
from specq.db.types import BigId, JSONType, UTCDateTime, utcnow

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default=JobState.QUEUED, index=True)
    target: Mapped[str] = mapped_column(Text)
    draft: Mapped[str | None] = mapped_column(Text)
    input_name: Mapped[str] = mapped_column(Text)  # the input path as the user gave it
    # the resolved generation settings (decoding config, default sampling, device, dtype, chunk size, ...),
    # written and read only through `jobs.settings.JobSettings`
    settings: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # counters, updated in the same transaction as the results they count
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    generated_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    # when its chunks were last sent to the broker; None: never (the job runs in-process). A sweeper
    # compares it with the broker's messages to find chunks whose message was lost (a Redis restart)
    enqueued_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # OpenAI Batch's job-level fields: `submit --metadata` pairs, `--completion-window` as given and the
    # time it ends at (requests not run by then expire), the `model` reported in OpenAI-format output
    user_metadata: Mapped[dict[str, str] | None] = mapped_column(JSONType)
    completion_window: Mapped[str | None] = mapped_column(String(16))
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    served_model_name: Mapped[str | None] = mapped_column(Text)

    # the database deletes children (ON DELETE CASCADE); the ORM neither loads nor orphans them
    requests: Mapped[list[Request]] = relationship(back_populates="job", lazy="raise", passive_deletes="all")
    batches: Mapped[list[Batch]] = relationship(back_populates="job", lazy="raise", passive_deletes="all")


class Request(Base):
    __tablename__ = "requests"
    __table_args__ = (UniqueConstraint("job_id", "seq"),)  # also the index that claims and export use

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)  # 0-based position among the job's requests; chunk = seq // size
    line: Mapped[int] = mapped_column(Integer)  # 1-based line in the input file
    custom_id: Mapped[str] = mapped_column(Text)  # the line's `id` / `custom_id`
    kind: Mapped[str] = mapped_column(String(16))  # "completion" | "chat"
    prompt: Mapped[str | None] = mapped_column(Text)
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)
    prompt_token_ids: Mapped[list[int] | None] = mapped_column(JSONType)  # a completion prompt given as ids
    overrides: Mapped[dict[str, Any]] = mapped_column(JSONType)  # the sampling settings the line set
    model: Mapped[str | None] = mapped_column(Text)  # the line's `body.model`, echoed in OpenAI output
    # a line with `n` > 1 is stored as n requests (same line and custom_id), choice_index 0..n-1
    choice_index: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    state: Mapped[str] = mapped_column(String(16), default=RequestState.QUEUED)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # claims so far
    # times a worker handed it to the engine; one that reaches the job's max_attempts without a result
    # (its worker died each time) is failed instead of run again. A server default, so COPY may omit it
    starts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # the size of the suspect group its last start ran in (worker.claims: bisection); 0: a fresh batch
    start_group: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    lease_owner: Mapped[str | None] = mapped_column(String(200))  # the worker holding the claim
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    job: Mapped[Job] = relationship(back_populates="requests", lazy="raise")
    result: Mapped[Result | None] = relationship(back_populates="request", lazy="raise", passive_deletes="all")


# running requests by lease expiry, for the sweeper. Partial: queued and ended rows (nearly all of them)
# are not in it, which keeps bulk inserts fast (a full index on state made COPY twice as slow)
Index(
    "ix_requests_running_lease",
    Request.lease_expires_at,
    postgresql_where=text("state = 'running'"),
    sqlite_where=text("state = 'running'"),
)


class Result(Base):
    __tablename__ = "results"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    # unique: a request has exactly one result; writes are INSERT ... ON CONFLICT DO NOTHING
    request_id: Mapped[int] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"), unique=True)
    status: Mapped[str] = mapped_column(String(16))  # "completed" | "failed"
    completion: Mapped[str | None] = mapped_column(Text)
    token_ids: Mapped[list[int] | None] = mapped_column(JSONType)
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    draft_tokens: Mapped[int] = mapped_column(Integer, default=0)
    accepted_tokens: Mapped[int] = mapped_column(Integer, default=0)
    seed: Mapped[int | None] = mapped_column(BigInteger)
    latency_s: Mapped[float] = mapped_column(Float, default=0.0)
    error: Mapped[str | None] = mapped_column(Text)
    # per emitted token: {"token_id", "logprob", "top": [[id, logprob], ...]}; None unless the line asked
    logprobs: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)
    worker: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)

    request: Mapped[Request] = relationship(back_populates="result", lazy="raise")


class Batch(Base):
    """One engine run over a group of a chunk's requests, with the engine's raw counters."""

    __tablename__ = "batches"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    worker: Mapped[str] = mapped_column(String(200))
    device: Mapped[str] = mapped_column(String(32))
    size: Mapped[int] = mapped_column(Integer)  # requests in the batch
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # None: running, or its worker died
    num_drafts: Mapped[int] = mapped_column(BigInteger, default=0)
    num_draft_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    num_accepted_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    accepted_per_position: Mapped[list[int]] = mapped_column(JSONType, default=list)
    num_generated_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    num_steps: Mapped[int] = mapped_column(BigInteger, default=0)
    target_forwards: Mapped[int] = mapped_column(BigInteger, default=0)
    draft_forwards: Mapped[int] = mapped_column(BigInteger, default=0)
    prefill_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    seconds: Mapped[float] = mapped_column(Float, default=0.0)  # wall time inside the engine
    # EngineStats.by_proposer: {proposer: {drafts, draft_tokens, accepted_tokens}}; None before 0003
    by_proposer: Mapped[dict[str, dict[str, int]] | None] = mapped_column(JSONType)

    job: Mapped[Job] = relationship(back_populates="batches", lazy="raise")


class Worker(Base):
    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    device: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(16))  # "idle" | "busy" | "stopped"
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    current_batch: Mapped[int | None] = mapped_column(BigInteger)  # batches.id while busy
    current_job: Mapped[str | None] = mapped_column(String(32))
    # what `--compile` did with the models the worker loaded last (models.loading.ModelPair.compile_report);
    # None until it loads models with compile other than off, and before 0006
    compiled: Mapped[dict[str, Any] | None] = mapped_column(JSONType)


class TrainedDraft(Base):
    """The draft head a `--draft train:N` job trains for itself (worker/trained_draft.py): who trains it,
    until when their claim holds, and once trained its config and weights, which every worker of the job
    loads onto its own target."""

    __tablename__ = "trained_drafts"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    state: Mapped[str] = mapped_column(String(16))  # db.states.DraftTrainingState
    # the worker training it, and when its claim lapses unless renewed (a dead trainer's is taken over)
    owner: Mapped[str | None] = mapped_column(String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    head_config: Mapped[dict[str, Any] | None] = mapped_column(JSONType)  # decoding.draft_head.HeadConfig
    head_weights: Mapped[bytes | None] = mapped_column(LargeBinary)  # a head folder's weights file
    report: Mapped[dict[str, Any] | None] = mapped_column(JSONType)  # distill.job_head.TrainedHead.report
    # why it failed, or why it is untrained or rejected; the job went on without it
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
