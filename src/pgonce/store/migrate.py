"""Applying pgonce's migrations.

Each migration runs in its own transaction together with its ledger row, under a transaction-scoped
advisory lock, so two ``pgonce migrate`` at once apply each migration exactly once: the second
waits, then finds it recorded. Up to date means nothing runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from pgonce import sql as pgsql
from pgonce.config import validate_schema
from pgonce.core.frozen import refuse_changes
from pgonce.core.retention import format_duration
from pgonce.errors import MigrationError, SchemaNotMigrated
from pgonce.store.cursors import cursor
from pgonce.store.errors import first_line, translate_errors


@refuse_changes
@dataclass(frozen=True, slots=True)
class SchemaStatus:
    current: int
    latest: int

    @property
    def up_to_date(self) -> bool:
        return self.current == self.latest

    @property
    def newer(self) -> bool:
        """Migrated by a newer pgonce: nothing here may run its migrations, nor undo them."""
        return self.current > self.latest


def newer_schema_error(schema: str, state: SchemaStatus) -> MigrationError:
    return MigrationError(
        f"schema {schema} is at version {state.current}, newer than the latest this pgonce knows "
        f"({state.latest}): a newer pgonce migrated it; nothing was applied or undone: run "
        "`pgonce migrate` with that version"
    )


#: How long one migration's statement waits for a lock on a table before the try is given up.
#: While DDL waits for its lock, every later statement on that table queues behind it: a long
#: transaction holding a row of pgonce.keys stalled every claim for as long as it lasted. Two
#: seconds is a stall a request survives (its pool wait and retries); the try is then rolled
#: back, the queue drains, and the next try comes after a pause.
DEFAULT_LOCK_TIMEOUT = timedelta(seconds=2)

#: Tries of one migration before ``migrate`` gives up with :class:`MigrationError`. With the
#: default timeout and pauses growing by it, about half a minute in all.
DEFAULT_LOCK_TRIES = 5


class _LockBusy(Exception):
    """A try that waited its lock_timeout out; its transaction was rolled back."""


class _RunnerBusy(Exception):
    """The runners' own lock waited ``lock_wait`` out: another runner holds it."""


def _ddl(text: str) -> bytes:
    # DDL comes from pgonce's own files; the connection's search_path makes its names pgonce's.
    return text.encode()


def _apply_one(
    conn: psycopg.Connection[Any],
    schema: str,
    migration_text: str,
    version: int,
    name: str,
    lock_timeout_ms: str = "0",
    lock_wait_ms: str | None = None,
) -> bool:
    q = pgsql.Queries("migrate", schema)
    with conn.transaction():
        if lock_wait_ms is None:
            cursor(conn).execute(q.lock, {"schema": schema})
        else:
            cursor(conn).execute(q.lock_timeout, {"timeout_ms": lock_wait_ms})
            try:
                cursor(conn).execute(q.lock, {"schema": schema})
            except pg_errors.LockNotAvailable as error:
                raise _RunnerBusy(first_line(error)) from error
        # After the runners' own lock: a second `pgonce migrate` waits for the first whatever
        # its migration takes (an index on a large table); only table locks are bounded.
        cursor(conn).execute(q.lock_timeout, {"timeout_ms": lock_timeout_ms})
        cursor(conn).execute(q.create_schema)
        cursor(conn).execute(q.create_ledger)
        applied = {row[0] for row in cursor(conn).execute(q.applied)}
        if version in applied:
            return False
        cursor(conn).execute(q.use_schema, {"schema": schema})
        try:
            cursor(conn).execute(_ddl(migration_text))
        except pg_errors.LockNotAvailable as error:
            raise _LockBusy(first_line(error)) from error
        except psycopg.Error as error:
            raise MigrationError(
                f"migration {version:04d}_{name} failed: {first_line(error)}"
            ) from error
        cursor(conn).execute(q.record, {"version": version, "name": name})
        return True


def migrate(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    on_applied: Callable[[int, str], None] | None = None,
    lock_timeout: timedelta = DEFAULT_LOCK_TIMEOUT,
    lock_tries: int = DEFAULT_LOCK_TRIES,
    lock_wait: timedelta | None = None,
) -> list[int]:
    """Apply every pending migration; return the versions this call applied.

    ``conn`` must be idle (no open transaction): each migration commits on its own. A migration
    that cannot get a table's lock within ``lock_timeout`` is rolled back and tried again after
    a pause, ``lock_tries`` times in all, then :class:`MigrationError` names what it waited for.

    Each migration first takes the runners' own lock, held by another runner for as long as its
    migration takes. With ``lock_wait`` a wait for it longer than that ends in
    :class:`MigrationError` (``pgonce serve`` sets it: a start must end); without, it waits.
    """
    timeout_ms = _milliseconds(lock_timeout)
    wait_ms = None if lock_wait is None else _milliseconds(lock_wait)
    # The name reaches search_path as text, where PostgreSQL folds an unquoted name to lower
    # case: "Tenant-A" built its tables in an existing schema "tenant-a", or nowhere.
    validate_schema(schema)
    done: list[int] = []
    with translate_errors("migrating"):
        for migration in pgsql.migrations():
            try:
                applied = _apply_tries(
                    conn, schema, migration, timeout_ms, lock_timeout, lock_tries, wait_ms
                )
            except _RunnerBusy as busy:
                raise MigrationError(
                    f"waited {format_duration(lock_wait or timedelta())} for the migration lock "
                    f"of schema {schema}, to apply or skip migration {migration.version:04d}_"
                    f"{migration.name} ({busy}): another pgonce migrate, or a pgonce serve "
                    "starting, holds it while it migrates this database (see pg_locks, locktype "
                    "advisory, and pg_stat_activity); nothing of it was applied: start again "
                    "once that one has finished"
                ) from busy.__cause__
            if applied:
                done.append(migration.version)
                if on_applied:
                    on_applied(migration.version, migration.name)
    return done


def _apply_tries(
    conn: psycopg.Connection[Any],
    schema: str,
    migration: pgsql.Migration,
    timeout_ms: str,
    lock_timeout: timedelta,
    tries: int,
    wait_ms: str | None = None,
) -> bool:
    for attempt in range(1, max(1, tries) + 1):
        try:
            return _apply_one(
                conn, schema, migration.text, migration.version, migration.name, timeout_ms, wait_ms
            )
        except _LockBusy as busy:
            if attempt >= tries:
                raise MigrationError(
                    f"migration {migration.version:04d}_{migration.name} waited {lock_timeout} "
                    f"for a lock {tries} times ({busy}): a long transaction holds one of "
                    "pgonce's tables (see pg_stat_activity); nothing of it was applied: run "
                    "`pgonce migrate` again once that transaction ended"
                ) from busy.__cause__
            time.sleep(lock_timeout.total_seconds() * attempt)
    return False


def _milliseconds(duration: timedelta) -> str:
    return str(max(1, round(duration / timedelta(milliseconds=1))))


def apply_schema_file(conn: psycopg.Connection[Any], schema: str) -> None:
    """Build the schema from ``schema.sql`` in one go and record every migration as applied.

    Used by the test that proves migrations and ``schema.sql`` give the same database, and by test
    fixtures that want a fresh database quickly.
    """
    validate_schema(schema)
    q = pgsql.Queries("migrate", schema)
    with translate_errors("applying schema.sql"), conn.transaction():
        cursor(conn).execute(q.lock, {"schema": schema})
        cursor(conn).execute(q.create_schema)
        cursor(conn).execute(q.create_ledger)
        cursor(conn).execute(q.use_schema, {"schema": schema})
        cursor(conn).execute(_ddl(pgsql.schema_sql()))
        for migration in pgsql.migrations():
            cursor(conn).execute(q.record, {"version": migration.version, "name": migration.name})


def status(conn: psycopg.Connection[Any], schema: str) -> SchemaStatus:
    """Which migration the database is at, and which is the latest this code knows."""
    validate_schema(schema)
    latest = pgsql.migrations()[-1].version
    q = pgsql.Queries("migrate", schema)
    try:
        with translate_errors("reading the schema version"), conn.transaction():
            row = cursor(conn).execute(q.current_version).fetchone()
    except SchemaNotMigrated:
        return SchemaStatus(current=0, latest=latest)
    return SchemaStatus(current=int(row[0]) if row else 0, latest=latest)


def pending(conn: psycopg.Connection[Any], schema: str) -> tuple[pgsql.Migration, ...]:
    """The migrations the ledger does not record, read without writing anything (no lock, no
    CREATE): safe on a read-only node or a standby. Every migration when the schema or its
    ledger does not exist yet.

    An empty answer means there is nothing to apply; anything else is for :func:`migrate`,
    which takes the runners' lock and reads the ledger again under it.
    """
    validate_schema(schema)
    q = pgsql.Queries("migrate", schema)
    try:
        with translate_errors("reading the applied migrations"), conn.transaction():
            applied = {int(row[0]) for row in cursor(conn).execute(q.applied)}
    except SchemaNotMigrated:
        return pgsql.migrations()
    return tuple(m for m in pgsql.migrations() if m.version not in applied)
