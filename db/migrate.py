"""Alembic, driven from code: `specq db upgrade`, and on first use by the commands that write
(`submit`, `worker`, `autoscale`), through `open_migrated`. Opening a database (`db.session`) never migrates."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, text

from specq.db.session import Database, at_head, open_database

if TYPE_CHECKING:
    from alembic.config import Config

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
_LOCK_ID = 0x5_0EC_0001  # PostgreSQL advisory lock: one migrating process at a time


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
    assert after is not None
    return before, after


def ensure_schema(db: Database) -> Database:
    """Upgrade to head unless the database is there already (a cheap check); returns `db`."""
    if not at_head(db):
        upgrade(db)
    return db


def open_migrated(url: str | None = None) -> Database:
    """`open_database`, then the schema brought to head: for the commands that write."""
    return ensure_schema(open_database(url))
