"""`pgonce migrate` at its edges: a schema name PostgreSQL would fold, a database a newer pgonce
migrated, an empty database asked for its status, and a run killed in the middle of a migration."""

from __future__ import annotations

import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from pgonce import sql as pgsql
from pgonce.errors import ConfigError, MigrationError
from pgonce.store.migrate import _apply_one, apply_schema_file, migrate, status
from tests.test_cli import pgonce
from tests.test_migrations import describe

ROOT = Path(__file__).resolve().parent.parent
LATEST = pgsql.migrations()[-1].version


@pytest.mark.parametrize("name", ["Tenant-A", "tenant-a", 'a"b', "x" * 64])
def test_a_schema_name_postgresql_would_fold_is_refused_before_anything_is_built(
    empty_dsn: str, name: str
) -> None:
    # The name reached search_path as text, folded to lower case there: "Tenant-A" built its
    # tables in another application's schema "tenant-a" (or failed half-way, its ledger made).
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute('CREATE SCHEMA "tenant-a"')
        for call in (migrate, apply_schema_file, status):
            with pytest.raises(ConfigError, match="not allowed"):
                call(conn, name)
        built = conn.execute(
            "SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', "
            "'pg_toast')"
        ).fetchall()
        assert built == []
        schemas = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg_%' "
            "AND nspname NOT IN ('public', 'information_schema') ORDER BY 1"
        ).fetchall()
        assert schemas == [("tenant-a",)]


def test_a_schema_a_newer_pgonce_migrated_is_refused_loudly_and_left_alone(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate(conn, "pgonce")
        conn.execute(
            "INSERT INTO pgonce.schema_migrations (version, name) VALUES (%s, 'from_the_future')",
            (LATEST + 1,),
        )
    for args in ((), ("--status",)):
        run = pgonce("migrate", "--dsn", empty_dsn, *args)
        # Neither "up to date" nor "pending" (a deploy script would wait for ever): an error.
        assert run.returncode == 1, run
        assert f"newer than the latest this pgonce knows ({LATEST})" in run.stderr, run
        assert "Traceback" not in run.stderr
        assert "pending" not in run.stdout
        assert "up to date" not in run.stdout
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        state = status(conn, "pgonce")
        assert state.newer
        assert state.current == LATEST + 1
    # The operator commands run on it, as the service does, with a warning: telling the operator
    # to run `pgonce migrate`, which refuses, would leave a rollback with no way forward.
    run = pgonce("replay", "--outbox", "--dsn", empty_dsn)
    assert run.returncode == 1, run  # nothing parked to replay
    assert "pgonce: replayed 0 parked outbox row(s)" in run.stderr, run
    assert f"newer than the latest this pgonce knows ({LATEST})" in run.stderr, run
    assert "run `pgonce migrate`" not in run.stderr


def test_status_of_an_empty_database_says_version_0_and_builds_nothing(empty_dsn: str) -> None:
    run = pgonce("migrate", "--dsn", empty_dsn, "--status")
    assert run.returncode == 1, run
    assert f"version 0 of {LATEST}; migrations pending" in run.stdout
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regnamespace('pgonce')").fetchone() == (None,)


def test_a_run_killed_inside_a_migration_leaves_nothing_half_applied(
    empty_dsn: str, dsn: str
) -> None:
    # The ledger exists and is held in SHARE mode: the run applies 0001's DDL, then waits to
    # record it. Killed there, its transaction takes the DDL with it; the next run finishes.
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate(conn, "pgonce")
        conn.execute("DROP SCHEMA pgonce CASCADE")
        conn.execute(
            "CREATE SCHEMA pgonce; CREATE TABLE pgonce.schema_migrations (version integer "
            "PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
    with psycopg.connect(empty_dsn) as holder:
        holder.execute("LOCK TABLE pgonce.schema_migrations IN SHARE MODE")
        run = subprocess.Popen(
            [sys.executable, "-m", "pgonce", "migrate", "--dsn", empty_dsn],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        with psycopg.connect(empty_dsn, autocommit=True) as watcher:
            # Waits on the server's own event: the run's INSERT into the ledger blocked.
            while not watcher.execute(
                "SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "WHERE c.relname = 'schema_migrations' AND NOT l.granted"
            ).fetchone():
                watcher.execute("SELECT pg_sleep(0.05)")
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
        holder.rollback()
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regclass('pgonce.keys')").fetchone() == (None,)
        assert migrate(conn, "pgonce") == [m.version for m in pgsql.migrations()]
    assert describe(empty_dsn, "pgonce") == describe(dsn, "pgonce")


def test_a_migration_blocked_by_a_long_transaction_gives_up_instead_of_stalling_claims(
    empty_dsn: str,
) -> None:
    # DDL waiting for a table's lock queues every later statement on that table behind it: a
    # transaction holding pgonce.keys stalled all claims for as long as it lasted, migrate too.
    # 0019 locks keys (its DROP INDEX); later ones (0020 alters functions only) lock no table.
    migrations = pgsql.migrations()
    at = next(i for i, m in enumerate(migrations) if m.version == 19)
    before, blocked, rest = migrations[:at], migrations[at], [m.version for m in migrations[at:]]
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        for migration in before:
            _apply_one(conn, "pgonce", migration.text, migration.version, migration.name)
    with psycopg.connect(empty_dsn) as holder:
        holder.execute("SELECT count(*) FROM pgonce.keys")  # ACCESS SHARE until rollback
        with (
            psycopg.connect(empty_dsn, autocommit=True) as conn,
            pytest.raises(MigrationError, match="long transaction") as refused,
        ):
            migrate(conn, "pgonce", lock_timeout=timedelta(milliseconds=200), lock_tries=2)
        assert f"{blocked.version:04d}_{blocked.name}" in str(refused.value)
        holder.rollback()
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert status(conn, "pgonce").current == before[-1].version
        assert migrate(conn, "pgonce") == rest
