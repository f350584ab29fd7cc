"""Health on real PostgreSQL: stuck claims, both ends of the retention horizon, overdue rows, and
``pgonce doctor``'s table and exit codes (run as a subprocess)."""

from __future__ import annotations

import functools
import threading
import time
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from pgonce.core.retention import Retention, RetentionPolicy
from pgonce.errors import DatabaseUnavailable, UsageError
from pgonce.sql import migrations
from pgonce.store._async.health import AsyncHealthCheck as AnyAsyncHealthCheck
from pgonce.store._sync.health import HealthCheck as AnyHealthCheck
from pgonce.store._sync.sweeper import Sweeper as AnySweeper
from tests.stalling import proxy_to
from tests.test_cli import pgonce
from tests.test_sweeper import DAY, NOW, add_keys

# These tests judge the key store's rows; the inbox and outbox targets have their own tests.
HealthCheck = functools.partial(AnyHealthCheck, targets=["keys"])
AsyncHealthCheck = functools.partial(AnyAsyncHealthCheck, targets=["keys"])
Sweeper = functools.partial(AnySweeper, targets=["keys"])

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


def test_a_young_table_is_quiet(dsn: str) -> None:
    # A new deployment: the oldest row is a day old, and the sweeper has deleted nothing.
    add_keys(dsn, 3, age=DAY)
    with psycopg.connect(dsn) as conn:
        Sweeper().sweep(conn, now=NOW)
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = HealthCheck().check(conn, now=NOW)
    assert report.status == "ok"
    (young,) = [f for f in report.findings if f.check == "oldest row vs retry horizon"]
    assert (young.status, young.value) == ("ok", "1d")
    assert "young table" in young.detail


def test_a_quiet_spell_after_old_rows_were_swept_is_not_early_deletion(dsn: str) -> None:
    # Rows of 40 days were swept; traffic then paused, and the oldest row left is a day old.
    add_keys(dsn, 4, age=40 * DAY)
    add_keys(dsn, 2, age=DAY, prefix="new-")
    with psycopg.connect(dsn) as conn:
        assert Sweeper().sweep(conn, now=NOW).deleted == 4
    found = check(dsn)
    assert found[("oldest row vs retry horizon", "*")] == ("ok", "1d")


def test_early_deletion_is_caught(dsn: str) -> None:
    # One sweeper runs with a retention of 1d (its own horizon 1d): it deletes keys of 2d that
    # this check's senders (3d) still retry.
    add_keys(dsn, 3, age=2 * DAY)
    add_keys(dsn, 1, age=DAY // 2, prefix="new-")
    short = RetentionPolicy(default=Retention(keep=DAY, retry_horizon=DAY))
    with psycopg.connect(dsn) as conn:
        assert Sweeper([short]).sweep(conn, now=NOW).deleted == 3
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = HealthCheck().check(conn, now=NOW)
    assert report.status == "fail"
    (early,) = [f for f in report.findings if f.check == "oldest row vs retry horizon"]
    assert (early.status, early.value) == ("fail", "12h; one deleted at 2d")
    assert "a retry of it would run again" in early.detail
    # Once the retry horizon has passed since that row's first delivery, no retry can come.
    with psycopg.connect(dsn, autocommit=True) as conn:
        later = HealthCheck().check(conn, now=NOW + 2 * DAY)
    assert [f.status for f in later.findings if f.check == "oldest row vs retry horizon"] == ["ok"]


def test_early_deletion_is_judged_per_scope_group(dsn: str) -> None:
    # "fast" keeps 1d by design; its deletions say nothing about the other scopes.
    add_keys(dsn, 2, age=2 * DAY, scope="fast")
    add_keys(dsn, 2, age=DAY, prefix="o")
    fast = {"fast": Retention(keep=DAY, retry_horizon=DAY)}
    with psycopg.connect(dsn) as conn:
        assert Sweeper([RetentionPolicy(scopes=fast)]).sweep(conn, now=NOW).deleted == 2
    found = check(dsn, HealthCheck([RetentionPolicy(scopes=fast)]))
    assert found[("oldest row vs retry horizon", "fast")][0] == "ok"
    assert found[("oldest row vs retry horizon", "*")] == ("ok", "1d")
    # A check that believes "fast" is retried for 3d sees the early deletion there only.
    strict = check(dsn, HealthCheck([RetentionPolicy(scopes={"fast": Retention()})]))
    assert strict[("oldest row vs retry horizon", "fast")][0] == "fail"
    assert strict[("oldest row vs retry horizon", "*")][0] == "ok"


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
def test_doctor_parked_rows_fail_only_with_strict(
    dsn: str, strict: tuple[str, ...], code: int
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO pgonce.outbox (aggregatetype, aggregateid, type, payload, parked_at, "
            "attempts, last_error) VALUES ('order', '1', 'placed', '{}', now(), 5, 'refused')"
        )
    exit_code, out = doctor(dsn, *strict)
    assert exit_code == code
    assert "parked" in out


def test_doctor_passes_a_young_table_and_fails_early_deletion(dsn: str) -> None:
    add_keys(dsn, 2, age=DAY)
    code, out = doctor(dsn, "--strict")
    assert code == 0, out
    add_keys(dsn, 2, age=2 * DAY, prefix="old-")
    short = RetentionPolicy(default=Retention(keep=DAY, retry_horizon=DAY))
    with psycopg.connect(dsn) as conn:
        Sweeper([short]).sweep(conn, now=NOW)
    code, out = doctor(dsn)
    assert code == 1
    assert "FAIL oldest row vs retry horizon (keys, *)" in out


def test_doctor_refuses_a_retention_shorter_than_the_horizon(dsn: str) -> None:
    done = pgonce("doctor", "--dsn", dsn, "--retention", "1d")
    assert done.returncode == 1
    assert "every scope is 1d, shorter than its retry horizon of 3d" in done.stderr


def test_early_deletion_of_inbox_events_is_caught(dsn: str) -> None:
    # Handled deliveries of 2 days, swept by a sweeper that keeps the inbox 1 day.
    with psycopg.connect(dsn) as conn:
        conn.execute(
            """INSERT INTO pgonce.inbox (source, event_id, body, headers, digest, received_at,
                                         status, next_attempt_at, processed_at)
               SELECT 'github', g::text, '{}', '{}', sha256(g::text::bytea), %(at)s, 'done',
                      %(at)s, %(at)s
                 FROM generate_series(1, 3) AS g""",
            {"at": NOW - 2 * DAY},
        )
    short = RetentionPolicy("inbox", Retention(keep=DAY, retry_horizon=DAY))
    with psycopg.connect(dsn) as conn:
        assert AnySweeper([short], targets=["inbox"]).sweep(conn, now=NOW).deleted == 3
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = AnyHealthCheck(targets=["inbox"]).check(conn, now=NOW)
        marks = conn.execute("SELECT target, scope, deleted FROM pgonce.sweep_marks").fetchall()
    assert marks == [("inbox", "github", 3)]
    (early,) = [f for f in report.findings if f.check == "oldest row vs retry horizon"]
    assert early.status == "fail"


def test_metrics_carry_the_newest_deleted_row_and_a_quiet_young_table(dsn: str) -> None:
    from pgonce.service.metrics import ServiceMetrics

    add_keys(dsn, 2, age=DAY)
    with psycopg.connect(dsn, autocommit=True) as conn:
        young = HealthCheck().check(conn, now=NOW)
    metrics = ServiceMetrics()
    metrics.set_health(young)
    text = metrics.render().decode()
    assert "pgonce_health_status 0.0" in text
    assert "pgonce_health_newest_deleted_seconds{" not in text
    add_keys(dsn, 2, age=2 * DAY, prefix="old-")
    short = RetentionPolicy(default=Retention(keep=DAY, retry_horizon=DAY))
    with psycopg.connect(dsn) as conn:
        Sweeper([short]).sweep(conn, now=NOW)
    with psycopg.connect(dsn, autocommit=True) as conn:
        metrics.set_health(HealthCheck().check(conn, now=NOW))
    text = metrics.render().decode()
    assert "pgonce_health_status 2.0" in text
    assert 'pgonce_health_newest_deleted_seconds{group="*",target="keys"} 172800.0' in text


# ## The MVCC horizon: an open transaction elsewhere in the database


def test_no_open_transaction_leaves_the_horizon_free(direct_dsn: str) -> None:
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        report = HealthCheck().check(conn)
    assert report.mvcc is not None
    assert report.mvcc.oldest is None
    found = {f.check: f for f in report.findings}
    assert (found["oldest transaction"].status, found["oldest transaction"].value) == ("ok", "none")


def test_an_idle_transaction_pinning_the_horizon_is_reported(direct_dsn: str) -> None:
    """A session left idle in a transaction that took an xid: the check names its age and state
    and warns past the threshold; /metrics reads the same figures from the report."""
    with (
        psycopg.connect(direct_dsn) as holder,
        psycopg.connect(direct_dsn, autocommit=True) as conn,
    ):
        holder.execute("SELECT txid_current()")  # BEGIN is implicit: the session stays in it
        report = HealthCheck(horizon_warn=timedelta(0)).check(conn)
        relaxed = HealthCheck().check(conn)
        holder.rollback()
        after = HealthCheck(horizon_warn=timedelta(0)).check(conn)
    assert report.mvcc is not None
    assert report.mvcc.oldest is not None
    assert report.mvcc.state == "idle in transaction"
    assert report.mvcc.xmin_age >= 0
    assert report.mvcc.sees_all
    found = {f.check: f for f in report.findings}["oldest transaction"]
    assert found.status == "warn"
    assert "idle_in_transaction_session_timeout" in found.detail
    assert {f.check: f for f in relaxed.findings}["oldest transaction"].status == "ok"
    assert {f.check: f for f in after.findings}["oldest transaction"].status == "ok"


def test_the_horizon_judgement() -> None:
    from pgonce.core.mvcc import MvccHorizon, judge_mvcc_horizon

    fine = MvccHorizon(timedelta(seconds=3), "active", 10, sees_all=True)
    assert judge_mvcc_horizon(fine).status == "ok"
    pinned = MvccHorizon(timedelta(hours=2), "idle in transaction", 90_000, sees_all=True)
    assert judge_mvcc_horizon(pinned).status == "warn"
    assert judge_mvcc_horizon(pinned).value == "2h (idle in transaction)"
    blind = MvccHorizon(None, None, 0, sees_all=False)
    assert judge_mvcc_horizon(blind).status == "warn"
    assert "pg_monitor" in judge_mvcc_horizon(blind).detail


def test_a_naive_now_is_refused(dsn: str) -> None:
    # Read in the session's time zone, a naive clock would shift every age the report judges.
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        pytest.raises(UsageError, match="timezone-aware"),
    ):
        HealthCheck().check(conn, now=NOW.replace(tzinfo=None))


def test_a_pending_migration_fails_the_check_and_a_newer_schema_warns(dsn: str) -> None:
    # Every other figure reads fine without the last migration's index or trigger: the report
    # must not call that database healthy.
    latest = migrations()[-1].version
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert check(dsn)[("schema version", "*")] == ("ok", str(latest))
        conn.execute("DELETE FROM pgonce.schema_migrations WHERE version = %s", (latest,))
        assert check(dsn)[("schema version", "*")] == ("fail", str(latest - 1))
        report = HealthCheck().check(conn, now=NOW)
        assert report.status == "fail"
        assert "pgonce migrate" in report.findings[0].detail
        conn.execute(
            "INSERT INTO pgonce.schema_migrations (version, name) VALUES (%s, 'x'), (%s, 'y')",
            (latest, latest + 1),
        )
        assert check(dsn)[("schema version", "*")] == ("warn", str(latest + 1))


def test_doctor_fails_on_a_pending_migration(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "DELETE FROM pgonce.schema_migrations WHERE version = %s",
            (migrations()[-1].version,),
        )
    code, out = doctor(dsn)
    assert code == 1
    (line,) = [line for line in out.splitlines() if line.startswith("schema version")]
    assert line.split()[-1] == "FAIL"


def _through(proxy_port: int, dsn: str) -> str:
    return make_conninfo(dsn, host="127.0.0.1", port=str(proxy_port))


def test_a_stalled_network_ends_the_check_with_a_typed_error(direct_dsn: str) -> None:
    # Requests arrive, answers do not: the server's statement timeout fires but its error never
    # comes back. The check must end on its own, not wait forever.
    with proxy_to(direct_dsn) as proxy:
        conn = psycopg.connect(_through(proxy.port, direct_dsn), autocommit=True)
        try:
            proxy.hold(True)
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable, match="no answer within"):
                HealthCheck(timeout=timedelta(milliseconds=500)).check(conn)
            assert time.monotonic() - started < 10
            assert conn.broken or conn.closed
        finally:
            conn.close()


async def test_a_stalled_network_ends_the_async_check_with_a_typed_error(
    direct_dsn: str,
) -> None:
    with proxy_to(direct_dsn) as proxy:
        conn = await psycopg.AsyncConnection.connect(
            _through(proxy.port, direct_dsn), autocommit=True
        )
        try:
            proxy.hold(True)
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable, match="no answer within"):
                await AsyncHealthCheck(timeout=timedelta(milliseconds=500)).check(conn)
            assert time.monotonic() - started < 10
        finally:
            await conn.close()


def test_a_check_that_answers_in_time_leaves_the_connection_usable(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(3):
            HealthCheck(timeout=timedelta(milliseconds=200)).check(conn, now=NOW)
        # Every watchdog of the checks above has ended without firing: none can touch the
        # connection later.
        for thread in threading.enumerate():
            if thread.name == "pgonce-health-watchdog":
                thread.join(timeout=10)
                assert not thread.is_alive()
        assert conn.execute("SELECT 1").fetchone() == (1,)


async def test_the_wrong_kind_of_connection_is_refused_at_the_call(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
        with pytest.raises(UsageError, match="AsyncHealthCheck"):
            HealthCheck().check(aconn)  # type: ignore[arg-type]
        with pytest.raises(UsageError, match="AsyncSweeper"):
            Sweeper().sweep(aconn)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="not None"):
        HealthCheck().check(None)  # type: ignore[arg-type]


def test_a_check_inside_the_callers_transaction_leaves_its_settings_alone(dsn: str) -> None:
    # The check's SET LOCAL statement_timeout, in a savepoint released, outlived the check and
    # bounded every later statement of the caller's transaction.
    with psycopg.connect(dsn) as conn:
        conn.execute("SET LOCAL statement_timeout = '0'")
        HealthCheck(timeout=timedelta(seconds=7)).check(conn, now=NOW)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)


@pytest.mark.parametrize("name", ["stuck_after", "slack", "horizon_warn", "retired_window"])
def test_thresholds_that_are_no_span_or_negative_are_refused_when_made(name: str) -> None:
    # A number reached the server as a bad cast (stuck_after) or the judgement as a bare
    # TypeError, at the first check rather than here.
    bad: dict[str, Any] = {name: 5}
    with pytest.raises(UsageError, match=name):
        HealthCheck(**bad)
    bad[name] = timedelta(minutes=-1)
    with pytest.raises(UsageError, match="negative"):
        HealthCheck(**bad)


def test_a_stalled_network_ends_the_durability_probe(direct_dsn: str) -> None:
    # /readyz reads it: on a stalled network each probe held its pooled connection for good.
    with proxy_to(direct_dsn) as proxy:
        conn = psycopg.connect(_through(proxy.port, direct_dsn), autocommit=True)
        try:
            proxy.hold(True)
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable):
                HealthCheck(timeout=timedelta(milliseconds=500)).durability(conn)
            assert time.monotonic() - started < 10
        finally:
            conn.close()


def test_a_stalled_network_ends_the_failed_rows_read_with_a_typed_error(direct_dsn: str) -> None:
    # `pgonce doctor` reads them after the health check, on the same connection, with no bound.
    from pgonce.store._sync.health import stalled
    from pgonce.store._sync.inspect import Inspector

    with proxy_to(direct_dsn) as proxy:
        conn = psycopg.connect(_through(proxy.port, direct_dsn), autocommit=True)
        try:
            proxy.hold(True)
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable, match=r"no answer within 0\.5s") as failed:
                Inspector(timeout=timedelta(milliseconds=500)).troubles(conn)
            assert stalled(failed.value)
            assert time.monotonic() - started < 10
            assert conn.broken or conn.closed
        finally:
            conn.close()


async def test_a_stalled_network_ends_the_async_failed_rows_read_with_a_typed_error(
    direct_dsn: str,
) -> None:
    from pgonce.store._async.inspect import AsyncInspector

    with proxy_to(direct_dsn) as proxy:
        conn = await psycopg.AsyncConnection.connect(
            _through(proxy.port, direct_dsn), autocommit=True
        )
        try:
            proxy.hold(True)
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable, match="reading failed rows failed: no answer"):
                await AsyncInspector(timeout=timedelta(milliseconds=500)).troubles(conn)
            assert time.monotonic() - started < 10
        finally:
            await conn.close()


def test_doctor_on_a_server_that_stops_answering_says_so_and_exits_1(direct_dsn: str) -> None:
    # The server freezes at doctor's read of the failed rows, after the health check answered.
    from tests.stalling import freezing

    add_keys(direct_dsn, 5, age=10 * DAY)
    with freezing(direct_dsn, b"'outbox' AS part") as proxy:
        started = time.monotonic()
        done = pgonce(
            "doctor", "--dsn", proxy.dsn(direct_dsn), "--target", "keys", "--timeout", "500ms"
        )
        assert proxy.frozen.is_set()
    assert time.monotonic() - started < 30
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "pgonce: error: reading failed rows failed: no answer within 1s, so the connection was "
        "closed: the server or the network is stalled"
    )
