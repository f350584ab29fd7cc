"""Translation of psycopg errors into pgonce's exception tree, once, at the store boundary.

The psycopg error stays attached as ``__cause__``; messages name the host and the cause, never the
password of a connection string.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict

from pgonce.errors import DatabaseError, DatabaseUnavailable, SchemaNotMigrated

# SQLSTATEs that mean "pgonce's objects are not there": the schema was never migrated.
_MISSING_OBJECT = (
    pg_errors.UndefinedTable,
    pg_errors.UndefinedFunction,
    pg_errors.InvalidSchemaName,
)


def describe_dsn(dsn: str) -> str:
    """``host:port/dbname`` of a connection string, without user or password."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "an unparsable connection string"
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    port = str(params.get("port") or "5432")
    dbname = str(params.get("dbname") or params.get("user") or "")
    where = f"{host}:{port}" if not host.startswith("/") else f"socket {host}"
    return f"{where}/{dbname}" if dbname else where


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextmanager
def translate_errors(what: str) -> Iterator[None]:
    """Run a store operation; re-raise psycopg failures as pgonce errors naming ``what`` failed."""
    try:
        yield
    except _MISSING_OBJECT as error:
        raise SchemaNotMigrated(
            f"{what} failed: {first_line(error)}; run `pgonce migrate` on this database"
        ) from error
    except psycopg.OperationalError as error:
        raise DatabaseUnavailable(f"{what} failed: {first_line(error)}") from error
    except psycopg.Error as error:
        raise DatabaseError(f"{what} failed: {first_line(error)}") from error
