"""A statement_timeout, lock_timeout or idle_in_transaction_session_timeout that the database or
the role sets, short enough to cut pgonce's own statements, is a warning of the doctor's, naming
the setting, its value, where it is set and how to remove it. The health check runs under its own
statement timeout, so without this line its figures read fine while every delivery is cut."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from pgonce.cli.doctor import render
from pgonce.core.retention import Finding, ServerTimeout, judge_server_timeouts
from pgonce.store._sync.health import HealthCheck


def _line(dsn: str) -> tuple[Finding, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = HealthCheck().check(conn)
    return {f.check: f for f in report.findings}["server timeouts"], render(report)


def _database(dsn: str) -> str:
    name = conninfo_to_dict(dsn)["dbname"]
    assert isinstance(name, str)
    return name


def test_a_database_statement_timeout_that_cuts_every_statement_is_warned_about(
    direct_dsn: str,
) -> None:
    name = _database(direct_dsn)
    fine, _ = _line(direct_dsn)
    with psycopg.connect(direct_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET statement_timeout = '20ms'").format(sql.Identifier(name))
        )
    line, doctor = _line(direct_dsn)
    assert fine.status == "ok", fine
    assert line.status == "warn", line
    assert "statement_timeout 20ms" in line.value
    assert f"set for database {name!r}" in line.detail
    assert f'ALTER DATABASE "{name}" RESET statement_timeout' in line.detail
    assert "1s" in line.detail  # the threshold, said
    assert "WARN server timeouts" in doctor


def test_a_role_lock_timeout_in_the_database_is_warned_about_with_its_role(
    direct_dsn: str,
) -> None:
    name = _database(direct_dsn)
    with psycopg.connect(direct_dsn, autocommit=True) as admin:
        role = admin.execute("SELECT session_user").fetchone()
        assert role is not None
        # Scoped to this test's own database: dropped with it.
        admin.execute(
            sql.SQL("ALTER ROLE {} IN DATABASE {} SET lock_timeout = '5ms'").format(
                sql.Identifier(role[0]), sql.Identifier(name)
            )
        )
        # A longer database-wide one is overridden by the role's, as PostgreSQL does.
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET lock_timeout = '10s'").format(sql.Identifier(name))
        )
    line, _ = _line(direct_dsn)
    assert line.status == "warn", line
    assert "lock_timeout 5ms" in line.value
    assert f"set for role {role[0]!r} in database {name!r}" in line.detail
    assert f'ALTER ROLE "{role[0]}" IN DATABASE "{name}" RESET lock_timeout' in line.detail


def test_a_timeout_of_seconds_is_left_alone(direct_dsn: str) -> None:
    name = _database(direct_dsn)
    with psycopg.connect(direct_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET statement_timeout = '30s'").format(sql.Identifier(name))
        )
        admin.execute(
            sql.SQL("ALTER DATABASE {} SET idle_in_transaction_session_timeout = '5min'").format(
                sql.Identifier(name)
            )
        )
    line, _ = _line(direct_dsn)
    assert line.status == "ok", line


@pytest.mark.parametrize(
    ("ms", "status"), [(0, "ok"), (1, "warn"), (999, "warn"), (1000, "ok"), (60_000, "ok")]
)
def test_the_threshold(ms: int, status: str) -> None:
    line = judge_server_timeouts([ServerTimeout("statement_timeout", ms)])
    assert line.status == status
    if status == "warn":
        assert "postgresql.conf" in line.detail
        assert "ALTER ROLE ... SET statement_timeout" in line.detail


def test_a_shorter_threshold_can_be_asked_for() -> None:
    timeouts = [ServerTimeout("idle_in_transaction_session_timeout", 500, database="app")]
    assert judge_server_timeouts(timeouts, timedelta(milliseconds=100)).status == "ok"
    assert judge_server_timeouts(timeouts).status == "warn"
