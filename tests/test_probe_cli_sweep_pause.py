"""``pgonce sweep --pause`` longer than a day: a usage error before anything connects. Before, a
pause beyond what the platform can sleep (30000000d) ended the run in an internal error
(OverflowError) after its first batch had deleted rows."""

from __future__ import annotations

import psycopg

from tests.test_cli import pgonce


def test_a_pause_longer_than_a_day_is_a_usage_error() -> None:
    result = pgonce(
        "sweep", "--dsn", "postgresql://postgres@127.0.0.1:1/test", "--pause", "30000000d"
    )
    assert result.returncode == 2, result.stderr
    assert "argument --pause: '30000000d' is longer than 1d" in result.stderr
    assert "cannot connect" not in result.stderr


def test_a_day_is_taken(direct_dsn: str) -> None:
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgonce.keys SELECT 's', 'k', sha256('x'), now() - interval '30 days', "
            "now() - interval '30 days', 200, '{}', ''"
        )
    # One row, batches of 2: the first batch is short, so the run ends without a pause.
    result = pgonce(
        "sweep", "--dsn", direct_dsn, "--target", "keys", "--batch-size", "2", "--pause", "1d"
    )
    assert result.returncode == 0, result.stderr
    assert "keys 1" in result.stdout
