"""``pgonce migrate`` on a node that takes no writes (default_transaction_read_only, as a standby
answers). Up to date, it reads the ledger and says so, exit 0: before, it ran CREATE SCHEMA IF NOT
EXISTS first and failed, although its help says it then does nothing. With migrations pending it
still refuses, naming the node as one that takes no writes, and creates nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psycopg
from psycopg.conninfo import make_conninfo

from pgonce import sql as pgsql

ROOT = Path(__file__).resolve().parent.parent
LATEST = pgsql.migrations()[-1].version


def _read_only(dsn: str) -> str:
    return make_conninfo(dsn, options="-c default_transaction_read_only=on")


def _migrate(dsn: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgonce", "migrate", "--dsn", dsn, *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _ledger(dsn: str, schema: str) -> list[tuple[int, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            f"SELECT version, applied_at::text FROM {schema}.schema_migrations ORDER BY version"
        ).fetchall()
    return [(int(v), str(t)) for v, t in rows]


def test_up_to_date_on_a_read_only_node_says_so_and_writes_nothing(direct_dsn: str) -> None:
    before = _ledger(direct_dsn, "pgonce")
    run = _migrate(_read_only(direct_dsn))
    assert run.returncode == 0, run.stderr
    assert f"schema pgonce is up to date (version {LATEST})" in run.stdout
    assert "error" not in run.stderr
    assert _ledger(direct_dsn, "pgonce") == before


def test_up_to_date_under_another_schema_name(empty_dsn: str) -> None:
    done = _migrate(empty_dsn, "--schema", "tenant_a")
    assert done.returncode == 0, done.stderr
    run = _migrate(_read_only(empty_dsn), "--schema", "tenant_a")
    assert run.returncode == 0, run.stderr
    assert f"schema tenant_a is up to date (version {LATEST})" in run.stdout


def test_pending_on_a_read_only_node_is_refused_and_creates_nothing(empty_dsn: str) -> None:
    run = _migrate(_read_only(empty_dsn), "--schema", "not_yet")
    assert run.returncode == 1, run.stdout
    assert "takes no writes" in run.stderr
    assert "standby" in run.stderr
    assert "Traceback" not in run.stderr
    assert "internal error" not in run.stderr
    assert "up to date" not in run.stdout
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_namespace WHERE nspname = 'not_yet'"
        ).fetchone()
    assert found == (0,)


def test_a_missing_migration_below_the_latest_is_still_applied(direct_dsn: str) -> None:
    # The ledger's highest version is the latest, but one below it is not recorded: pending,
    # so the read-only node refuses and a writable one applies it (as before).
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM pgonce.schema_migrations WHERE version = 1")
    run = _migrate(_read_only(direct_dsn))
    assert run.returncode == 1, run.stdout
    assert "takes no writes" in run.stderr
    assert "up to date" not in run.stdout
