"""What ``pgonce sweep`` is pointed at: each table once, and a schema that holds pgonce's tables.

A --target given twice swept its table twice and reported it twice ("keys 0, keys 0"), and doctor
printed each of its checks twice. A mistyped --schema ran every table's batch against nothing: a
warning per table, then an error naming one of them, where replay refuses it in one line.
"""

from __future__ import annotations

import psycopg
import pytest

from tests.test_cli import pgonce


def test_a_target_given_twice_is_swept_once(dsn: str) -> None:
    result = pgonce("sweep", "--dsn", dsn, "--target", "keys", "--target", "keys")
    assert result.returncode == 0, result.stderr
    assert "(keys 0) in 1 batch," in result.stdout, result.stdout


def test_a_target_given_twice_is_checked_once(dsn: str) -> None:
    result = pgonce("doctor", "--dsn", dsn, "--target", "keys", "--target", "keys")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("overdue rows") == 1, result.stdout


@pytest.mark.parametrize("dry_run", [(), ("--dry-run",)])
def test_a_schema_without_pgonce_tables_is_refused_in_one_line(
    dsn: str, dry_run: tuple[str, ...]
) -> None:
    result = pgonce("sweep", "--dsn", dsn, "--schema", "no_pgonce_here", *dry_run)
    assert result.returncode == 1, result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line == (
        "pgonce: error: schema no_pgonce_here holds no pgonce tables: check --schema and --dsn, "
        "or run `pgonce migrate` to create them"
    )
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'no_pgonce_here'").fetchone()
    assert row is None
