"""The completer in the service: its configuration, its loop, health's stuck phases."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from pgonce import ConfigError, HealthCheck, fingerprint
from pgonce.core.retention import DEFAULT_RETIRED_WINDOW
from pgonce.phases import AsyncPhaseStore, CompleterPass, PhaseStore
from pgonce.service.config import load
from pgonce.service.metrics import ServiceMetrics
from pgonce.store._async.phases import complete_every
from pgonce.store._sync.sweeper import Sweeper
from tests.phases import operations

FP = fingerprint("POST", "/payments")


def test_the_completer_section_registers_operations_by_name(tmp_path: Path) -> None:
    path = tmp_path / "pgonce.toml"
    path.write_text(
        '[completer]\nevery = "2s"\nretire_after = 3\n'
        '[completer.operations]\npay = "tests.phases.operations:pay"\n'
    )
    config = load(path, {})
    assert config.completer is not None
    assert config.completer.operations == {"pay": operations.pay}
    assert config.completer.every == timedelta(seconds=2)
    assert config.completer.retire_after == 3
    assert config.completer.max_age == timedelta(hours=1)

    path.write_text('[completer.operations]\npay = "tests.phases.operations:nothing"\n')
    with pytest.raises(ConfigError, match=r"completer\.operations\.pay"):
        load(path, {})
    path.write_text('[completer]\nevery = "5s"\n')
    assert load(path, {}).completer is None  # nothing registered, nothing to run


async def test_the_completer_loop_finishes_an_abandoned_request_and_counts_it(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE payments (key text PRIMARY KEY)")
        # Claimed two minutes ago by a holder that died: its 30 s lease has run out.
        started = datetime.now(UTC) - timedelta(minutes=2)
        PhaseStore().start(conn, "t", "p1", FP, operation="pay", args={"amount": 7}, now=started)
    metrics = ServiceMetrics()
    stop = asyncio.Event()
    passes: list[CompleterPass] = []

    def on_run(done: CompleterPass) -> None:
        metrics.record_completer(done)
        passes.append(done)
        stop.set()

    async with AsyncConnectionPool(dsn, min_size=1, max_size=1) as pool:
        await complete_every(pool, AsyncPhaseStore(), {"pay": operations.pay}, stop, on_run=on_run)
    assert [(p.finished, p.failed, p.retired) for p in passes] == [(1, 0, 0)]
    assert b'pgonce_completer_requests_total{outcome="finished"} 1.0' in metrics.render()
    with psycopg.connect(dsn, autocommit=True) as conn:
        replay = PhaseStore().start(conn, "t", "p1", FP)
        assert replay.response is not None
        assert replay.response.body == b"paid 7"
        assert conn.execute("SELECT count(*) FROM payments").fetchone() == (1,)


def test_health_shows_stuck_two_phase_requests_with_their_point(dsn: str) -> None:
    t0 = datetime(2031, 1, 1, tzinfo=UTC)
    with psycopg.connect(dsn, autocommit=True) as conn:
        store = PhaseStore()
        op = store.start(conn, "t", "s1", FP, now=t0)
        op.call("charge", lambda idem: {"id": "ch"}, now=t0)
        store.start(conn, "t", "s2", FP, now=t0)
        store.start(conn, "t", "s3", FP, now=t0 + timedelta(hours=1))  # still fresh
        report = HealthCheck().check(conn, now=t0 + timedelta(hours=1, minutes=1))
    (keys,) = [s for s in report.stuck if s.target == "keys"]
    assert keys.phases == (("", 1), ("charge", 1))
    metrics = ServiceMetrics()
    metrics.set_health(report)
    assert b'pgonce_health_stuck_phases{point="charge"} 1.0' in metrics.render()
    (finding,) = [f for f in report.findings if f.check == "stuck claims"]
    assert finding.status == "fail"
    assert "two-phase stopped at: claimed 1, charge 1" in finding.value


@pytest.mark.parametrize("by_ctid", [True, False], ids=["ctid", "key"])
async def test_health_counts_the_requests_the_completer_retired(dsn: str, by_ctid: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Claimed two minutes ago by a client that died after the charge; every holder since
        # fails after it too.
        started = datetime.now(UTC) - timedelta(minutes=2)
        op = PhaseStore().start(conn, "t", "r1", FP, operation="broken", args={}, now=started)
        op.call("charge", lambda idem: {"id": "ch"}, now=started)
        before = HealthCheck().check(conn)
    (finding,) = [f for f in before.findings if f.check == "retired requests"]
    assert (finding.status, finding.value) == ("ok", "0")

    stop = asyncio.Event()
    passes: list[CompleterPass] = []

    def on_run(done: CompleterPass) -> None:
        passes.append(done)
        if done.retired or len(passes) == 3:
            stop.set()

    operations_ = {"broken": operations.broken}
    async with AsyncConnectionPool(dsn, min_size=1, max_size=1) as pool:
        await complete_every(
            pool,
            AsyncPhaseStore(),
            operations_,
            stop,
            every=timedelta(milliseconds=10),
            retire_after=2,
            on_run=on_run,
        )
    # The completer's first holder failed (attempt 2), its second retired the request.
    assert [(p.finished, p.failed, p.retired) for p in passes] == [(0, 1, 0), (0, 0, 1)]

    with psycopg.connect(dsn, autocommit=True) as conn:
        replay = PhaseStore().start(conn, "t", "r1", FP)
        assert replay.response is not None
        assert replay.response.status == 500
        report = HealthCheck().check(conn)
        (keys,) = [s for s in report.stuck if s.target == "keys"]
        assert keys.retired == (("charge", 1),)
        assert keys.phases == ()  # retired, so no longer stuck
        assert keys.retired_age is not None
        assert keys.retired_age < timedelta(minutes=1)
        (finding,) = [f for f in report.findings if f.check == "retired requests"]
        assert finding.status == "warn"
        assert finding.value.startswith("1 (newest ")
        assert finding.value.endswith("stopped at: charge 1")
        metrics = ServiceMetrics()
        metrics.set_health(report)
        assert b'pgonce_health_retired_phases{point="charge"} 1.0' in metrics.render()
        assert b"pgonce_health_status 1.0" in metrics.render()

        # Past the window it no longer warns, and is still counted until the key is swept.
        later = datetime.now(UTC) + DEFAULT_RETIRED_WINDOW + timedelta(minutes=1)
        (finding,) = [
            f
            for f in HealthCheck().check(conn, now=later).findings
            if f.check == "retired requests"
        ]
        assert finding.status == "ok"
        assert finding.value.startswith("1 (newest 1d")

        # The sweeper deletes the record with the key: the key can be claimed again.
        Sweeper(ctid=by_ctid).sweep(conn, now=datetime.now(UTC) + timedelta(days=60))
        assert conn.execute("SELECT count(*) FROM pgonce.key_leases").fetchone() == (0,)
        report = HealthCheck().check(conn)
        (keys,) = [s for s in report.stuck if s.target == "keys"]
        assert keys.retired == ()
        assert PhaseStore().start(conn, "t", "r1", FP).won
