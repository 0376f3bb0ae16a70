"""Alembic, driven from code: `specq db upgrade`, and on first use by the commands that need the schema."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, text
from sqlalchemy.exc import DBAPIError

from specq.db.session import Database

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
# The newest migration (tests/test_db.py checks it is alembic's single head). Every command checks the
# database against it with one query, so alembic, a quarter of a second of imports, loads only to migrate.
SCHEMA_HEAD = "0002"
_LOCK_ID = 0x5_0EC_0001  # PostgreSQL advisory lock: one migrating process at a time
_checked: set[str] = set()  # databases found at head in this process


def alembic_config(connection: Connection | None = None) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection  # env.py runs on this connection
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"the migrations have {len(heads)} heads; merge them")
    return heads[0]


def current_revision(db: Database) -> str | None:
    """The schema revision stored in the database; None for an empty database."""
    try:
        with db.engine.connect() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except DBAPIError:  # no alembic_version table yet
        return None


def upgrade(db: Database) -> tuple[str | None, str]:
    """Migrate the schema to head; returns (revision before, revision after)."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext

    with db.engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # several workers may start at once; the lock lasts until this transaction ends
            conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _LOCK_ID})
        before = MigrationContext.configure(conn).get_current_revision()
        command.upgrade(alembic_config(conn), "head")
        after = MigrationContext.configure(conn).get_current_revision()
    if before != after:
        log.info("database %s migrated from %s to %s", db.url, before, after)
    _checked.add(db.url)
    assert after is not None
    return before, after


def ensure_schema(db: Database) -> None:
    """Upgrade to head unless this process already saw the database there (a cheap check otherwise)."""
    if db.url in _checked:
        return
    if current_revision(db) != SCHEMA_HEAD:
        upgrade(db)
    _checked.add(db.url)
