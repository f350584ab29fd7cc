"""Health on real PostgreSQL: stuck claims, both ends of the retention horizon, overdue rows, and
``pgonce doctor``'s table and exit codes (run as a subprocess)."""

from __future__ import annotations

import functools
from datetime import timedelta

import psycopg
import pytest

from pgonce.core.retention import Retention, RetentionPolicy
from pgonce.store._async.health import AsyncHealthCheck as AnyAsyncHealthCheck
from pgonce.store._sync.health import HealthCheck as AnyHealthCheck
from tests.test_cli import pgonce
from tests.test_sweeper import DAY, NOW, add_keys

# These tests judge the key store's rows; the inbox and outbox targets have their own tests.
HealthCheck = functools.partial(AnyHealthCheck, targets=["keys"])
AsyncHealthCheck = functools.partial(AnyAsyncHealthCheck, targets=["keys"])

MINUTE = timedelta(minutes=1)


def check(dsn: str, health: AnyHealthCheck | None = None) -> dict[tuple[str, str], tuple[str, str]]:
    """``{(check, scope): (status, value)}`` of a health check at NOW."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = (health or HealthCheck()).check(conn, now=NOW)
    assert report.checked_at == NOW
    return {(f.check, f.scope or "*"): (f.status, f.value) for f in report.findings}


def test_a_healthy_table(dsn: str) -> None:
    add_keys(dsn, 5, age=10 * DAY)
    add_keys(dsn, 5, age=DAY, prefix="young-")
    add_keys(dsn, 2, age=1 * MINUTE, completed=False, prefix="running-")
    found = check(dsn)
    assert found[("stuck claims", "*")] == ("ok", "0")
    assert found[("oldest row vs retry horizon", "*")] == ("ok", "10d")
    assert found[("oldest row vs retention", "*")] == ("ok", "10d")
    assert found[("overdue rows", "*")] == ("ok", "0")


def test_claims_in_flight_past_the_threshold_are_stuck(dsn: str) -> None:
    add_keys(dsn, 3, age=20 * MINUTE, completed=False)
    add_keys(dsn, 4, age=5 * MINUTE, completed=False, prefix="recent-")
    found = check(dsn)
    assert found[("stuck claims", "*")] == ("fail", "3 (oldest 20m)")
    relaxed = check(dsn, HealthCheck(stuck_after=30 * MINUTE))
    assert relaxed[("stuck claims", "*")] == ("ok", "0")


def test_rows_past_retention_and_slack_mean_the_sweeper_stalled(dsn: str) -> None:
    add_keys(dsn, 6, age=32 * DAY)
    add_keys(dsn, 4, age=10 * DAY, prefix="fine-")
    found = check(dsn)
    assert found[("oldest row vs retention", "*")] == ("fail", "32d")
    assert found[("overdue rows", "*")] == ("ok", "6")


def test_a_young_oldest_row_warns(dsn: str) -> None:
    add_keys(dsn, 3, age=DAY)
    found = check(dsn)
    assert found[("oldest row vs retry horizon", "*")] == ("warn", "1d")
    assert found[("oldest row vs retention", "*")] == ("ok", "1d")


def test_each_scope_group_is_judged_by_its_own_retention(dsn: str) -> None:
    add_keys(dsn, 2, age=60 * DAY, scope="audit")
    add_keys(dsn, 3, age=60 * DAY, scope="api")
    add_keys(dsn, 1, age=20 * DAY, scope="api", prefix="b")
    policy = RetentionPolicy(scopes={"audit": Retention(keep=90 * DAY), "empty": Retention()})
    found = check(dsn, HealthCheck([policy]))
    assert found[("oldest row vs retention", "audit")] == ("ok", "60d")
    assert found[("overdue rows", "audit")] == ("ok", "0")
    assert found[("oldest row vs retention", "*")] == ("fail", "60d")
    assert found[("overdue rows", "*")] == ("ok", "3")
    assert found[("oldest row vs retention", "empty")] == ("ok", "no rows")


async def test_the_async_check_reports_the_same_figures(dsn: str) -> None:
    add_keys(dsn, 2, age=40 * DAY)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        report = await AsyncHealthCheck().check(conn, now=NOW)
    (group,) = report.groups
    assert (group.overdue, group.oldest_age) == (2, 40 * DAY)
    assert not report.ok


def doctor(dsn: str, *args: str) -> tuple[int, str]:
    done = pgonce("doctor", "--dsn", dsn, "--target", "keys", "--now", NOW.isoformat(), *args)
    assert "Traceback" not in done.stderr
    return done.returncode, done.stdout


def test_doctor_prints_a_table_and_exits_0_when_healthy(dsn: str) -> None:
    add_keys(dsn, 5, age=10 * DAY)
    code, out = doctor(dsn)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["check", "target", "scope", "value", "limit", "status"]
    assert lines[1].startswith("-----")
    assert any(line.split()[-1] == "ok" and "stuck claims" in line for line in lines)
    assert lines[-1].endswith(": OK")


def test_doctor_exits_1_and_says_why_when_a_check_fails(dsn: str) -> None:
    add_keys(dsn, 2, age=30 * MINUTE, completed=False)
    code, out = doctor(dsn)
    assert code == 1
    assert "FAIL stuck claims (keys, *)" in out
    assert out.splitlines()[-1].endswith(": FAIL")


@pytest.mark.parametrize(("strict", "code"), [((), 0), (("--strict",), 1)])
def test_doctor_warnings_fail_only_with_strict(
    dsn: str, strict: tuple[str, ...], code: int
) -> None:
    add_keys(dsn, 2, age=DAY)
    exit_code, out = doctor(dsn, *strict)
    assert exit_code == code
    assert "WARN oldest row vs retry horizon (keys, *)" in out


def test_doctor_refuses_a_retention_shorter_than_the_horizon(dsn: str) -> None:
    done = pgonce("doctor", "--dsn", dsn, "--retention", "1d")
    assert done.returncode == 1
    assert "every scope is 1d, shorter than its retry horizon of 3d" in done.stderr
