"""Alembic, driven from code: `specq db upgrade`, and on first use by the commands that need the schema."""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, text

from db.session import Database

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_LOCK_ID = 0x5_0EC_0001  # PostgreSQL advisory lock: one migrating process at a time
_checked: set[str] = set()  # databases found at head in this process


def alembic_config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection  # env.py runs on this connection
    return config


def head_revision() -> str:
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"the migrations have {len(heads)} heads; merge them")
    return heads[0]


def current_revision(db: Database) -> str | None:
    with db.engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(db: Database) -> tuple[str | None, str]:
    """Migrate the schema to head; returns (revision before, revision after)."""
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
    if current_revision(db) != head_revision():
        upgrade(db)
    _checked.add(db.url)
