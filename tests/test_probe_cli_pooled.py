"""The one-shot commands behind PgBouncer in transaction mode: they prepare no statement.

psycopg prepares a statement once it ran five times on a connection (``_pg3_0``, ...); behind a
transaction-mode pooler each transaction may reach another server session, where that name is
another client's or missing. ``pgonce migrate`` of a new schema failed at its sixth migration
(prepared statement "_pg3_0" already exists) and ``pgonce sweep`` after its fifth batch.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgonce import sql as pgsql
from pgonce.store.migrate import status
from tests.test_serve_edges import serve

ROOT = Path(__file__).resolve().parent.parent


def _pooled(pgbouncer_server_dsn: str, direct_dsn: str) -> str:
    return make_conninfo(pgbouncer_server_dsn, dbname=conninfo_to_dict(direct_dsn)["dbname"])


def _another_client_prepared(pooled: str) -> None:
    """Leave a statement that psycopg prepared under its first name on the pooler's server
    session, as any earlier client of the pooler does."""
    with psycopg.connect(pooled, autocommit=True, prepare_threshold=0) as conn:
        conn.execute("SELECT 1")


def _pgonce(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgonce", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_migrate_through_a_transaction_pooler_applies_every_migration(
    pgbouncer_server_dsn: str, direct_dsn: str
) -> None:
    pooled = _pooled(pgbouncer_server_dsn, direct_dsn)
    _another_client_prepared(pooled)
    run = _pgonce("migrate", "--dsn", pooled, "--schema", "pm")
    assert run.returncode == 0, run.stderr
    assert "prepared statement" not in run.stderr
    assert run.stdout.count("applied ") == len(pgsql.migrations())
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        assert status(conn, "pm").up_to_date


def test_sweep_through_a_transaction_pooler_runs_every_batch(
    pgbouncer_server_dsn: str, direct_dsn: str
) -> None:
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgonce.keys SELECT 's', 'k' || g, sha256('x'), "
            "now() - interval '30 days', now() - interval '30 days', 200, '{}', '' "
            "FROM generate_series(1, 20) g"
        )
    pooled = _pooled(pgbouncer_server_dsn, direct_dsn)
    _another_client_prepared(pooled)
    run = _pgonce(
        "sweep",
        "--dsn",
        pooled,
        "--target",
        "keys",
        "--batch-size",
        "1",
        "--max-batches",
        "100",
        "--pause",
        "0s",
    )
    assert run.returncode == 0, run.stderr
    assert "keys 20" in run.stdout, run.stdout
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)


def test_serve_migrates_a_new_database_through_a_transaction_pooler(
    pgbouncer_server_dsn: str, empty_dsn: str
) -> None:
    pooled = _pooled(pgbouncer_server_dsn, empty_dsn)
    _another_client_prepared(pooled)
    process = serve(pooled)
    try:
        assert process.stdout is not None
        up = process.stdout.readline()
        if not up.startswith("pgonce: serving on"):
            process.kill()
            raise AssertionError(process.communicate(timeout=60)[1])
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    assert "_pg3_" not in err
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert status(conn, "pgonce").up_to_date
