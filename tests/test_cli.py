"""The command line as a user meets it: help, one-line errors, and the demo's proof."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from pgonce.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent


def pgonce(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT, own_settings: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the command line; ``own_settings`` drops the PGONCE_* variables of this process."""
    base = {k: v for k, v in os.environ.items() if not (own_settings and k.startswith("PGONCE_"))}
    return subprocess.run(
        [sys.executable, "-m", "pgonce", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=180,
        env={**base, **(env or {})},
        check=False,
    )


def test_top_level_help_lists_every_command() -> None:
    result = pgonce("--help")
    assert result.returncode == 0
    for command in COMMANDS:
        assert command.NAME in result.stdout


@pytest.mark.parametrize("name", [c.NAME for c in COMMANDS])
def test_every_command_has_help(name: str) -> None:
    result = pgonce(name, "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: pgonce" in result.stdout
    assert len(result.stdout.splitlines()) > 3


def test_unreachable_database_is_one_clear_line() -> None:
    result = pgonce("migrate", "--dsn", "postgresql://nobody:s3cret@127.0.0.1:1/db")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pgonce: error: cannot connect to PostgreSQL at 127.0.0.1:1/db")
    assert "s3cret" not in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_setting_is_one_clear_line() -> None:
    result = pgonce("migrate", env={"PGONCE_SCHEMA": "Robert'); DROP TABLE students;--"})
    assert result.returncode == 1
    assert result.stderr.startswith("pgonce: error: schema name")
    assert "Traceback" not in result.stderr


def test_migrate_reports_up_to_date(dsn: str) -> None:
    result = pgonce("migrate", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout
    status = pgonce("migrate", "--status", "--dsn", dsn)
    assert status.returncode == 0
    assert "version" in status.stdout


def test_demo_proves_exactly_once(dsn: str) -> None:
    result = pgonce("demo", "--dsn", dsn, "--orders", "20", "--copies", "10", "--connections", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "exactly once: yes" in result.stdout
    effects = next(line for line in result.stdout.splitlines() if "side effects" in line)
    assert effects.split()[2] == "20"
    # The proof checked against the database, not taken from the demo's own words: one order row
    # per order, and one completed key per order.
    with psycopg.connect(dsn) as conn:
        orders = conn.execute(
            "SELECT count(*), count(DISTINCT order_ref), count(DISTINCT run_id) "
            "FROM pgonce_demo.orders"
        ).fetchone()
        keys = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE completed_at IS NOT NULL) FROM pgonce.keys "
            "WHERE scope LIKE 'demo:%'"
        ).fetchone()
    assert orders == (20, 20, 1)
    assert keys == (20, 20)


def test_replay_puts_parked_outbox_rows_back(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "INSERT INTO pgonce.outbox (aggregatetype, aggregateid, type, payload, parked_at, "
            "attempts, last_error) VALUES ('order', 'o-1', 'order.created', '{}', now(), 5, "
            "'refused') RETURNING id"
        ).fetchone()
    assert row is not None
    first = pgonce("replay", "--outbox", "--dsn", dsn)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == [str(row[0])]
    assert "replayed 1 parked outbox row(s)" in first.stderr
    again = pgonce("replay", "--outbox", "--dsn", dsn)
    assert again.returncode == 1
    mixed = pgonce("replay", "--outbox", "--event-id", "x", "--dsn", dsn)
    assert mixed.returncode != 0
    assert "--event-id goes with --source" in mixed.stderr
