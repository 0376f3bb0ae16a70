"""`specq db upgrade`: create or migrate the database schema."""

from __future__ import annotations

import click

from specq.cli.group import cli
from specq.cli.options import database_option, specq_errors


@cli.group("db")
def db() -> None:
    """Manage the results database."""


@db.command("upgrade")
@database_option
def upgrade(database_url: str | None) -> None:
    """Create or migrate the schema to the latest revision (submit, worker and autoscale also do this)."""
    with specq_errors():
        from specq.db.migrate import upgrade as migrate
        from specq.db.session import open_database

        database = open_database(database_url)
        before, after = migrate(database)
    if before == after:
        click.echo(f"{database.url}: schema already at revision {after}", err=True)
    else:
        click.echo(f"{database.url}: schema migrated from {before or 'empty'} to {after}", err=True)
