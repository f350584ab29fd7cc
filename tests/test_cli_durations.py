"""A zero duration where only a positive one means anything is refused by name, never taken as
"not given": ``--retention 0s`` swept with the default 30d retention instead."""

from __future__ import annotations

import pytest

from tests.test_cli import pgonce


@pytest.mark.parametrize(
    ("command", "option"),
    [
        ("sweep", "--retention"),
        ("sweep", "--retry-horizon"),
        ("sweep", "--statement-timeout"),
        ("doctor", "--retention"),
        ("doctor", "--timeout"),
    ],
)
def test_a_zero_duration_is_a_usage_error_naming_its_option(
    command: str, option: str, dsn: str
) -> None:
    result = pgonce(command, "--dsn", dsn, option, "0s", own_settings=True)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    last = result.stderr.strip().splitlines()[-1]
    assert f"argument {option}: " in last, last
    assert "longer than 0s" in last, last


@pytest.mark.parametrize("name", ["PGONCE_RETENTION", "PGONCE_RETRY_HORIZON"])
def test_a_zero_duration_in_the_environment_is_refused_by_name(name: str, dsn: str) -> None:
    result = pgonce("sweep", "--dsn", dsn, "--dry-run", env={name: "0s"}, own_settings=True)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert f"pgonce: error: {name}: " in result.stderr, result.stderr


@pytest.mark.parametrize("option", ["--dsn", "--config"])
def test_an_empty_dsn_or_config_is_a_usage_error(option: str) -> None:
    # `--dsn "$DATABASE_URL"` with the variable unset connected to libpq's default server (and
    # `pgonce migrate` would have migrated it); `--config ""` read the current folder.
    result = pgonce("migrate", "--status", "--require-dsn", option, "", own_settings=True)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"argument {option}: is empty" in result.stderr, result.stderr
    assert "using PostgreSQL" not in result.stderr
