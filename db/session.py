"""Engines and sessions from `SPECQ_DATABASE_URL`; an embedded SQLite file when it is not set."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from specq.errors import (
    DatabaseMissingError,
    DatabaseRefusedError,
    DatabaseUnreachableError,
    SchemaError,
    ServiceUnavailableError,
)
from specq.masking import mask_url
from specq.paths import data_dir

log = logging.getLogger(__name__)

DATABASE_ENV = "SPECQ_DATABASE_URL"
# The newest migration (tests/test_db.py checks it is alembic's single head). Readers and writers check
# the database against it with one query, so alembic, a quarter of a second of imports, loads only to migrate.
SCHEMA_HEAD = "0008"
_at_head: set[str] = set()  # databases found at SCHEMA_HEAD in this process


def resolve_url(url: str | None = None) -> str:
    """`url`, else `SPECQ_DATABASE_URL`, else the embedded SQLite file in specq's data directory."""
    return url or os.environ.get(DATABASE_ENV) or f"sqlite:///{data_dir() / 'specq.db'}"


def is_sqlite(engine: Engine) -> bool:
    return engine.dialect.name == "sqlite"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL: readers (status, --wait) never block the writer; foreign keys are off by default in SQLite
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


@dataclass(frozen=True)
class Database:
    engine: Engine
    sessions: sessionmaker[Session]
    url: str  # masked, for messages

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on error."""
        with self.sessions.begin() as session:
            yield session

    @property
    def is_sqlite(self) -> bool:
        return is_sqlite(self.engine)


# What PostgreSQL answers, before any query, where the connection will never be allowed: retrying these
# only delays the one line that says what is wrong. A server starting up or shutting down, or out of
# connection slots, answers otherwise and is waited for.
_MISSING_DATABASE = re.compile(r'database ".*" does not exist')
_REFUSALS = re.compile(
    r'role ".*" does not exist|authentication failed|no password supplied|no pg_hba\.conf entry|'
    r"permission denied for database|not permitted to log in"
)


def refusal(exc: BaseException) -> str | None:
    """`exc`'s reason where the server refused the connection for good (no such database, a wrong user or
    password, no access), else None (unreachable, or lost: worth waiting for)."""
    reason = str(getattr(exc, "orig", None) or exc).strip()
    if _MISSING_DATABASE.search(reason) or _REFUSALS.search(reason):
        return reason.splitlines()[0]
    return None


def unavailable(db_url: str, exc: BaseException) -> ServiceUnavailableError:
    """The error for a connection that failed: refused for good (DatabaseRefusedError, DatabaseMissingError)
    or unreachable (DatabaseUnreachableError, which readers wait out)."""
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
    if _MISSING_DATABASE.search(reason):
        return DatabaseMissingError(
            f"the database server at {mask_url(db_url)} has no database {make_url(db_url).database!r}: "
            "`specq db upgrade` creates it (where this user may create databases), or `createdb` it"
        )
    if refusal(exc):
        return DatabaseRefusedError(f"the database at {mask_url(db_url)} refused the connection: {reason}")
    return DatabaseUnreachableError(f"cannot reach the database at {mask_url(db_url)}: {reason}")


_databases: dict[str, Database] = {}


def _open(url: str) -> Database:
    if url in _databases:
        return _databases[url]
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        kwargs = {"connect_args": {"timeout": 30, "check_same_thread": False}}
        path = make_url(url).database
        if path and path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    else:
        kwargs["connect_args"] = {"connect_timeout": 5}
    engine = create_engine(url, **kwargs)
    if is_sqlite(engine):
        event.listen(engine, "connect", _sqlite_pragmas)
    db = _databases[url] = Database(engine, sessionmaker(engine, expire_on_commit=False), mask_url(url))
    return db


def open_database(url: str | None = None) -> Database:
    """Connect, checking the server answers. Never migrates: `db.migrate` does, for the commands that
    write (`submit`, `worker`, `autoscale`) and for `specq db upgrade`, so a read-only command changes nothing.

    Raises ServiceUnavailableError, with the URL's password masked, when the database cannot be reached.
    """
    resolved = resolve_url(url)
    try:
        db = _open(resolved)
        with db.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as exc:
        raise unavailable(resolved, exc) from None
    except Exception as exc:  # e.g. a malformed URL or a missing driver
        raise ServiceUnavailableError(f"cannot use the database at {mask_url(resolved)}: {exc}") from None
    return db


def current_revision(db: Database) -> str | None:
    """The schema revision stored in the database; None for an empty database."""
    try:
        with db.engine.connect() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except DBAPIError:  # no alembic_version table yet
        return None


def at_head(db: Database) -> bool:
    """Whether the database holds this specq's schema (one query, then remembered for the process)."""
    if db.url in _at_head:
        return True
    if current_revision(db) != SCHEMA_HEAD:
        return False
    _at_head.add(db.url)
    return True


def schema_ready(db: Database) -> bool:
    """For readers: True at SCHEMA_HEAD; False for an empty database (nothing stored yet, so it reads as
    holding nothing); SchemaError, telling the user to run `specq db upgrade`, at any other revision."""
    if at_head(db):
        return True
    revision = current_revision(db)
    if revision is None:
        return False
    raise SchemaError(
        f"the database at {db.url} has schema revision {revision}, this specq uses {SCHEMA_HEAD}: "
        "run `specq db upgrade`"
    )


def dispose_all() -> None:
    """Close every pooled connection and forget the engines (after a fork, and in tests)."""
    while _databases:
        _databases.popitem()[1].engine.dispose()


_identities: dict[str, str | None] = {}


def identity(db: Database) -> str | None:
    """Which database this is, the same through any URL that reaches it: PostgreSQL's cluster
    identifier and the database's name. Chunk messages carry it, so a worker pointed at another
    database gives their chunks back instead of dropping them as jobs that are gone. None on SQLite (a
    file no worker elsewhere shares): no check."""
    if db.url not in _identities:
        if db.is_sqlite:
            _identities[db.url] = None
        else:
            with db.engine.connect() as conn:
                row = conn.execute(
                    text("SELECT system_identifier::text, current_database() FROM pg_control_system()")
                ).one()
            _identities[db.url] = f"{row[0]}/{row[1]}"
    return _identities[db.url]
