"""A demo storm too large to hold is a usage error at the call (exit 2), before anything starts.

``pgonce demo --orders 1000000 --copies 1000000`` built a list of 10**12 deliveries in memory
until the machine ran out of it, and ``--connections 100000`` opened a pool of that many
connections on the server, taking every connection slot other clients had.
"""

from __future__ import annotations

import pytest

from pgonce.cli.demo import MAX_CONNECTIONS, MAX_DELIVERIES
from tests.test_cli import pgonce


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ("--orders", "1000000", "--copies", "1000000"),
            "--orders times --copies is 1,000,000,000,000 deliveries, more than "
            f"{MAX_DELIVERIES:,}",
        ),
        (
            ("--connections", str(MAX_CONNECTIONS + 1)),
            f"--connections {MAX_CONNECTIONS + 1:,} is more than {MAX_CONNECTIONS:,}",
        ),
        (
            ("--url", "http://127.0.0.1:1/", "--orders", str(MAX_DELIVERIES), "--copies", "2"),
            "deliveries, more than",
        ),
    ],
)
def test_a_storm_too_large_is_a_usage_error(args: tuple[str, ...], said: str) -> None:
    result = pgonce(
        "demo",
        *args,
        env={"PGONCE_DSN": "postgresql://u:hunter2@127.0.0.1:1/x"},
        own_settings=True,
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.startswith("usage: pgonce demo"), result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("pgonce demo: error: ")]
    assert said in line, line
    assert "hunter2" not in result.stderr


def test_a_small_storm_still_runs(dsn: str) -> None:
    # The bound refuses nothing a demo is run with: the default and a small one still prove it.
    result = pgonce("demo", "--dsn", dsn, "--orders", "5", "--copies", "2", "--connections", "2")
    assert result.returncode == 0, result.stderr
    assert "exactly once: yes" in result.stdout
