"""``pgonce migrate`` on a hot standby whose schema is up to date: it says so, exit 0, as its help
promises. Before, it ran CREATE SCHEMA IF NOT EXISTS first, which a standby refuses. With
migrations pending (another schema) it refuses, naming the node as a standby, and ``pgonce
serve`` still refuses to start there."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgonce import sql as pgsql
from pgonce.store.migrate import migrate
from tests.topology.cluster import scratch_cluster, scratch_standby

ROOT = Path(__file__).resolve().parent.parent
LATEST = pgsql.migrations()[-1].version


@pytest.fixture(scope="module")
def standby() -> Iterator[str]:
    """A hot standby of a scratch primary, which has replayed the primary's migrations."""
    with scratch_cluster() as primary:
        with psycopg.connect(primary, autocommit=True) as conn:
            migrate(conn, "pgonce")
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        with scratch_standby(primary) as node:
            with psycopg.connect(node, autocommit=True) as conn:
                deadline = time.monotonic() + 60
                while conn.execute(
                    "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (row[0],)
                ).fetchone() != (True,):
                    assert time.monotonic() < deadline, "the standby never replayed"
                    time.sleep(0.05)
            yield node


def _pgonce(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pgonce", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_migrate_on_an_up_to_date_standby_says_up_to_date(standby: str) -> None:
    run = _pgonce("migrate", "--dsn", standby)
    assert run.returncode == 0, run.stderr
    assert f"schema pgonce is up to date (version {LATEST})" in run.stdout


def test_migrate_with_migrations_pending_on_a_standby_is_refused(standby: str) -> None:
    run = _pgonce("migrate", "--dsn", standby, "--schema", "elsewhere")
    assert run.returncode == 1, run.stdout
    assert "the server takes no writes (a standby" in run.stderr
    assert "Traceback" not in run.stderr


def test_serve_still_refuses_to_start_on_a_standby(standby: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pgonce", "serve", "--dsn", standby, "--port", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 1, run.stderr
    assert "the server takes no writes (a standby" in run.stderr
    assert "serving on" not in run.stdout
