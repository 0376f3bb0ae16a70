"""Alembic environment: runs on the connection `db.migrate` passes in, or on `SPECQ_DATABASE_URL`."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from specq.db.models import Base
from specq.db.session import resolve_url

config = context.config
target_metadata = Base.metadata


def _configure(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
        compare_type=True,
    )


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(resolve_url(config.get_main_option("sqlalchemy.url") or None))
    with engine.begin() as conn:
        _configure(conn)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("specq migrations run online only: `specq db upgrade`")
run_migrations_online()
