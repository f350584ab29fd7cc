"""What pins the MVCC horizon, as the doctor's line says it: each kind of holder is named with
where to find it and how to end it. A replication slot has no session and no age, only an xmin;
a prepared transaction outlives every timeout; a running statement is cancelled, not left to
idle_in_transaction_session_timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest

from pgonce.core.retention import Finding
from pgonce.errors import UsageError
from pgonce.store._sync.health import HealthCheck
from tests.throwaway import Server, decoding_server


def _line(check: HealthCheck, dsn: str) -> Finding:
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = check.check(conn)
    return {f.check: f for f in report.findings}["oldest transaction"]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A server with logical decoding and prepared transactions, which the shared ones may lack."""
    with decoding_server("pgonce-mvcc-") as running:
        yield running


def test_a_replication_slot_holding_the_horizon_is_warned_about(server: Server) -> None:
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_create_logical_replication_slot('stopped_consumer', 'test_decoding')"
        )
        try:
            for _ in range(30):  # each its own transaction id, past the slot's catalog_xmin
                conn.execute("SELECT txid_current()")
            line = _line(HealthCheck(xmin_warn=20), server.dsn)
            quiet = _line(HealthCheck(), server.dsn)
        finally:
            conn.execute("SELECT pg_drop_replication_slot('stopped_consumer')")
        freed = _line(HealthCheck(xmin_warn=20), server.dsn)
    assert line.status == "warn", line
    assert line.value.startswith("none, oldest xmin ")
    assert "replication slot" in line.detail
    assert "pg_replication_slots" in line.detail
    assert "pg_drop_replication_slot" in line.detail
    assert quiet.status == "ok"  # 30 ids are far below the default
    assert freed.status == "ok", freed


def test_a_forgotten_prepared_transaction_is_told_how_to_end(server: Server) -> None:
    with psycopg.connect(server.dsn) as holder:
        holder.execute("SELECT txid_current()")
        holder.execute("PREPARE TRANSACTION 'forgotten'")
        holder.commit()
        try:
            line = _line(HealthCheck(horizon_warn=timedelta(0)), server.dsn)
        finally:
            holder.autocommit = True
            holder.execute("ROLLBACK PREPARED 'forgotten'")
    assert line.status == "warn"
    assert "(prepared)" in line.value
    assert "pg_prepared_xacts" in line.detail
    assert "ROLLBACK PREPARED" in line.detail
    # No session timeout ends a prepared transaction: that advice would not help.
    assert "idle_in_transaction_session_timeout" not in line.detail


def test_a_long_running_statement_is_told_how_to_cancel(direct_dsn: str) -> None:
    with psycopg.connect(direct_dsn, autocommit=True) as runner:
        pid = runner.info.backend_pid
        done = threading.Event()

        def report_query() -> None:
            try:
                runner.execute("SELECT pg_sleep(60)")
            except psycopg.errors.QueryCanceled:
                pass
            finally:
                done.set()

        thread = threading.Thread(target=report_query)
        thread.start()
        try:
            with psycopg.connect(direct_dsn, autocommit=True) as conn:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    row = conn.execute(
                        "SELECT state FROM pg_stat_activity WHERE pid = %s AND backend_xmin "
                        "IS NOT NULL",
                        (pid,),
                    ).fetchone()
                    if row and row[0] == "active":
                        break
                    time.sleep(0.02)
                line = _line(HealthCheck(horizon_warn=timedelta(0)), direct_dsn)
                conn.execute("SELECT pg_cancel_backend(%s)", (pid,))
        finally:
            done.wait(30)
            thread.join(30)
    assert line.status == "warn", line
    assert "(active)" in line.value
    assert "pg_cancel_backend" in line.detail
    assert "statement_timeout" in line.detail
    assert "idle_in_transaction_session_timeout" not in line.detail


def test_an_idle_transaction_is_told_where_its_session_is(direct_dsn: str) -> None:
    with psycopg.connect(direct_dsn, application_name="forgotten-console") as holder:
        holder.execute("SELECT txid_current()")
        line = _line(HealthCheck(horizon_warn=timedelta(0)), direct_dsn)
        holder.rollback()
    assert line.status == "warn"
    assert "pg_stat_activity" in line.detail
    assert "pg_terminate_backend" in line.detail
    assert "idle_in_transaction_session_timeout" in line.detail


@pytest.mark.parametrize("wrong", [-1, 1.5, True, "10"])
def test_xmin_warn_must_be_a_count(wrong: object) -> None:
    with pytest.raises(UsageError, match="xmin_warn"):
        HealthCheck(xmin_warn=wrong)  # type: ignore[arg-type]
