"""A scope given twice to ``--scope-retention`` (``pgonce sweep``, ``pgonce doctor``): a usage
error naming the scope, before anything connects. Before, the last one won without a word, so that
a retention typed again lower deleted rows that the first one kept."""

from __future__ import annotations

import pytest

from tests.test_cli import pgonce

NOWHERE = "postgresql://postgres@127.0.0.1:1/test"


@pytest.mark.parametrize("command", ["sweep", "doctor"])
def test_a_scope_given_twice_is_a_usage_error(command: str) -> None:
    result = pgonce(
        command,
        "--dsn",
        NOWHERE,
        "--scope-retention",
        "stripe=90d",
        "--scope-retention",
        "stripe=4d/3d",
    )
    assert result.returncode == 2, result.stderr
    assert "argument --scope-retention: scope 'stripe' is given twice" in result.stderr
    assert "cannot connect" not in result.stderr


def test_distinct_scopes_are_taken(direct_dsn: str) -> None:
    result = pgonce(
        "sweep",
        "--dsn",
        direct_dsn,
        "--scope-retention",
        "stripe=90d",
        "--scope-retention",
        "github=30d",
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("dry run: 0 rows would be deleted")
