"""`specq db upgrade` on a PostgreSQL server that has no database of the URL's name yet: create it, as
`createdb` would, where the URL's user may (a fresh server has only `postgres`)."""

from __future__ import annotations

import logging

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from specq.db.session import resolve_url
from specq.errors import DatabaseRefusedError
from specq.masking import mask_url

log = logging.getLogger(__name__)

# where the server is reached to run CREATE DATABASE: every PostgreSQL cluster has both
MAINTENANCE_DATABASES = ("postgres", "template1")
DUPLICATE_DATABASE = "42P04"  # another `db upgrade` created it first


def create_database(url: str | None = None) -> str:
    """CREATE DATABASE for the database of `url` (resolved as `open_database` resolves it), connecting
    to the server's maintenance database with the same user; returns its name.

    Call it where `open_database` raised DatabaseMissingError. DatabaseRefusedError, one line, where the
    user may not create databases or the server cannot be reached that way either."""
    resolved = make_url(resolve_url(url))
    name = resolved.database
    if resolved.get_backend_name() != "postgresql" or not name:
        raise DatabaseRefusedError(f"cannot create a database for {mask_url(str(resolved))}: PostgreSQL URLs only")
    failure: BaseException | None = None
    for maintenance in MAINTENANCE_DATABASES:
        engine = create_engine(
            resolved.set(database=maintenance), isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
        )
        try:
            with engine.connect() as conn:
                quoted = conn.dialect.identifier_preparer.quote(name)
                conn.execute(text(f"CREATE DATABASE {quoted}"))
            log.info("created database %s", name)
            return name
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) == DUPLICATE_DATABASE:
                return name
            failure = exc
        finally:
            engine.dispose()
    reason = str(getattr(failure, "orig", None) or failure).strip().splitlines()[0]
    raise DatabaseRefusedError(
        f"the database {name!r} does not exist at {mask_url(str(resolved))} and could not be created ({reason}): "
        f"`createdb {name}` as a user who may, then `specq db upgrade`"
    )
