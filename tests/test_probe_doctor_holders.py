"""The doctor's MVCC-horizon line names what holds the horizon: the session by pid,
application_name and the start of its query (never more than a short prefix: a query can carry
values), a prepared transaction by its gid, a replication slot by its slot_name."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest

from pgonce.cli.doctor import render
from pgonce.core.mvcc import MvccHorizon, judge_mvcc_horizon
from pgonce.core.retention import Finding
from pgonce.store._sync.health import HealthCheck
from tests.throwaway import Server, decoding_server


def _line(check: HealthCheck, dsn: str) -> tuple[Finding, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = check.check(conn)
    return {f.check: f for f in report.findings}["oldest transaction"], render(report)


def test_an_idle_transaction_is_named_by_pid_and_application_name(direct_dsn: str) -> None:
    secret = "x" * 80 + " card 4111111111111111"
    with psycopg.connect(direct_dsn, application_name="forgotten-console-7f3a") as holder:
        pid = holder.info.backend_pid
        holder.execute(f"SELECT txid_current(),\n  '{secret}'")
        line, doctor = _line(HealthCheck(horizon_warn=timedelta(0)), direct_dsn)
        holder.rollback()
    assert line.status == "warn", line
    assert f"pid {pid}" in line.detail
    assert "'forgotten-console-7f3a'" in line.detail
    assert f"pg_terminate_backend({pid})" in line.detail
    # The start of its query, on one line, and never the values past a short prefix.
    assert f'query "SELECT txid_current(), \'{"x" * 36}"' in line.detail
    assert "4111" not in line.detail
    assert "\n" not in line.detail
    assert f"pid {pid}" in doctor


def test_the_holder_is_said_with_its_session() -> None:
    horizon = MvccHorizon(
        timedelta(hours=1),
        "idle in transaction",
        10,
        sees_all=True,
        pid=42,
        application_name="app",
        what="UPDATE t SET a = 1",
    )
    line = judge_mvcc_horizon(horizon)
    assert (
        "(idle in transaction: pid 42, application_name 'app', query 'UPDATE t SET a = 1')"
        in line.detail
    )


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A server with logical decoding and prepared transactions, which the shared ones may lack."""
    with decoding_server("pgonce-holders-") as running:
        yield running


def test_a_replication_slot_is_named_by_slot_name(server: Server) -> None:
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('orders_cdc_9c1', 'test_decoding')")
        try:
            for _ in range(30):  # each its own transaction id, past the slot's catalog_xmin
                conn.execute("SELECT txid_current()")
            line, doctor = _line(HealthCheck(xmin_warn=20), server.dsn)
        finally:
            conn.execute("SELECT pg_drop_replication_slot('orders_cdc_9c1')")
    assert line.status == "warn", line
    assert "'orders_cdc_9c1'" in line.value
    assert "replication slot 'orders_cdc_9c1'" in line.detail
    assert "pg_drop_replication_slot('orders_cdc_9c1')" in line.detail
    assert "orders_cdc_9c1" in doctor


def test_a_prepared_transaction_is_named_by_gid(server: Server) -> None:
    with psycopg.connect(server.dsn) as holder:
        holder.execute("SELECT txid_current()")
        holder.execute("PREPARE TRANSACTION 'payment-batch-17'")
        holder.commit()
        try:
            line, _ = _line(HealthCheck(horizon_warn=timedelta(0)), server.dsn)
        finally:
            holder.autocommit = True
            holder.execute("ROLLBACK PREPARED 'payment-batch-17'")
    assert line.status == "warn", line
    assert "ROLLBACK PREPARED 'payment-batch-17'" in line.detail
