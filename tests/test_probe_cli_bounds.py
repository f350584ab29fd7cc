"""Numbers and words the database or the sweep cannot take are usage errors of the command line
(exit 2, with the usage), before anything runs: sweep's batch size, batch cap and statement
timeout, replay's outbox row ids, and a --scope-retention that does not read. They were refused
after the start, as exit 1, or by PostgreSQL ("bigint out of range") once connected."""

from __future__ import annotations

import pytest

from tests.test_cli import pgonce


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("sweep", "--batch-size", "0"), "argument --batch-size: 0 is not between 1 and"),
        (("sweep", "--batch-size", "-1"), "argument --batch-size: -1 is not between 1 and"),
        (("sweep", "--batch-size", str(2**63)), "argument --batch-size:"),
        (("sweep", "--max-batches", "0"), "argument --max-batches: 0 is not a whole number"),
        (("sweep", "--statement-timeout", "25d"), "longest statement timeout, 24 days"),
        (("replay", "--outbox", "--id", "0"), "argument --id: 0 is not between 1 and"),
        (("replay", "--outbox", "--id", str(10**23)), "argument --id:"),
        (("sweep", "--scope-retention", "stripe=abc"), "argument --scope-retention: 'abc'"),
        (("doctor", "--scope-retention", "stripe"), "write SCOPE=RETENTION"),
    ],
)
def test_a_number_out_of_range_is_a_usage_error(dsn: str, args: tuple[str, ...], said: str) -> None:
    result = pgonce(*args, "--dsn", dsn)
    assert result.returncode == 2, result.stderr
    assert said in result.stderr
    assert "usage: pgonce" in result.stderr
    assert "Traceback" not in result.stderr
    assert "out of range" not in result.stderr
    assert result.stdout == ""


def test_a_scope_retention_is_judged_against_the_retry_horizon_given_with_it(dsn: str) -> None:
    # 2d is shorter than the default horizon (3d), not than the one given here: it runs.
    result = pgonce(
        "sweep", "--retry-horizon", "1d", "--scope-retention", "stripe=2d", "--dry-run",
        "--dsn", dsn,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr


def test_the_longest_statement_timeout_still_runs(dsn: str) -> None:
    result = pgonce("sweep", "--statement-timeout", "24d", "--dry-run", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert "nothing was deleted" in result.stdout
