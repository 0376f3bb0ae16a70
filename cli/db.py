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
    """Create or migrate the schema to the latest revision (submit, worker and autoscale also do this).

    A PostgreSQL database that does not exist yet is created first, where the URL's user may create
    databases (as `createdb` would)."""
    with specq_errors():
        from specq.db.migrate import upgrade as migrate
        from specq.db.session import open_database
        from specq.errors import DatabaseMissingError

        try:
            database = open_database(database_url)
        except DatabaseMissingError:
            from specq.db.create import create_database

            name = create_database(database_url)
            database = open_database(database_url)
            click.echo(f"{database.url}: created the database {name}", err=True)
        before, after = migrate(database)
    if before == after:
        click.echo(f"{database.url}: schema already at revision {after}", err=True)
    else:
        click.echo(f"{database.url}: schema migrated from {before or 'empty'} to {after}", err=True)
