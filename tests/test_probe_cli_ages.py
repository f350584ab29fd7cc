"""Ages beyond what PostgreSQL can date back (``--retention 99999999d``, ``--stuck-after``,
``--slack``, a scope's retention or horizon): a usage error naming the option, before anything
connects. Before, ``pgonce sweep --dry-run`` and ``pgonce doctor`` connected and failed with
"timestamp out of range", exit 1."""

from __future__ import annotations

import pytest

from tests.test_cli import pgonce

NOWHERE = "postgresql://postgres@127.0.0.1:1/test"


@pytest.mark.parametrize(
    ("command", "option", "value"),
    [
        ("sweep", "--retention", "99999999d"),
        ("sweep", "--retry-horizon", "400000d"),
        ("sweep", "--scope-retention", "stripe=30d/400000d"),
        ("doctor", "--retention", "99999999d"),
        ("doctor", "--stuck-after", "99999999d"),
        ("doctor", "--slack", "400000d"),
    ],
)
def test_an_age_beyond_a_thousand_years_is_a_usage_error(
    command: str, option: str, value: str
) -> None:
    result = pgonce(command, "--dsn", NOWHERE, option, value, "--retry-horizon", "1d")
    assert result.returncode == 2, result.stderr
    assert f"argument {option}:" in result.stderr
    assert "a thousand years" in result.stderr
    assert "cannot connect" not in result.stderr


def test_a_thousand_years_is_taken(direct_dsn: str) -> None:
    result = pgonce("sweep", "--dsn", direct_dsn, "--retention", "365250d", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("dry run: 0 rows would be deleted")
