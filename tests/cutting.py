"""A server-set statement_timeout that cuts a loop's batches every time, and nothing else.

A timeout short enough to cut any statement (``1ms``) also cuts, on a loaded machine, the loop's
own lookup of the setting's value that names it in the report. Instead, a session opened before
the setting holds an ACCESS EXCLUSIVE lock on the table the loop claims from: every claim waits
for the lock until the database's statement_timeout cuts it, while a statement that does not read
the table (the lookup) has the whole timeout to run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict


@contextlib.contextmanager
def claims_cut_by_statement_timeout(dsn: str, table: str, timeout: str) -> Iterator[None]:
    """While inside, ``statement_timeout`` is ``timeout`` for new sessions of ``dsn``'s database
    (``ALTER DATABASE ... SET``) and every statement reading ``table`` (schema-qualified) waits
    until it cuts them."""
    name = str(conninfo_to_dict(dsn)["dbname"])
    with psycopg.connect(dsn) as holder:
        holder.execute(
            sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(
                sql.Identifier(*table.split("."))
            )
        )
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("ALTER DATABASE {} SET statement_timeout = {}").format(
                    sql.Identifier(name), sql.Literal(timeout)
                )
            )
        try:
            yield
        finally:
            holder.rollback()
