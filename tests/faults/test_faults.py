"""The short version of the fault suite (`make faults` is the long one): the same scenarios at a
small size, on the suite's own PostgreSQL and redis-server, against the real service processes.

A few kills, small storms, a few hundred generated bad inputs, one broker outage and the security
checks. The scan of every log and refusal they captured runs once for the whole session, after the
last test, over every xdist worker's modules (tests/logscan.py). A failure prints the module's
seed; set PGONCE_FAULTS_SEED to rerun with it. Each test fails on a lost or a
doubled effect, a 500, or a failed check, and prints the scenario's report section when it does.
"""

from __future__ import annotations

import psycopg
import pytest

from faults.context import Context
from faults.proxy import Proxy
from faults.report import Result, render
from faults.scenarios import badinput, broker, database, kills, pooler, security, storms, twophase
from tests.faults.conftest import SEED_ENV
from tests.pgbouncer import require_pgbouncer


def explain(result: Result, ctx: Context) -> str:
    rerun = f"rerun with {SEED_ENV}={ctx.seed} (the seed of this module's run)"
    return render([result], header=[f"# {result.scenario}", "", rerun, ""], seconds=result.seconds)


def assert_passed(result: Result, ctx: Context) -> None:
    assert result.error is None, explain(result, ctx)
    assert (result.acc.lost, result.acc.doubled, result.acc.http_500) == (0, 0, 0), explain(
        result, ctx
    )
    assert result.passed, explain(result, ctx)


async def test_storm_through_the_middleware(ctx: Context) -> None:
    result = await storms.middleware_storm(ctx)
    assert_passed(result, ctx)
    assert result.acc.effects == result.acc.sent == 10


async def test_storm_through_the_webhook_endpoint(ctx: Context) -> None:
    result = await storms.webhook_storm(ctx)
    assert_passed(result, ctx)
    assert result.acc.effects == result.acc.sent == 10


async def test_kill_nine_loses_nothing_and_doubles_nothing(ctx: Context) -> None:
    result = await kills.kill_nine(ctx)
    assert_passed(result, ctx)
    assert result.acc.sent > 0
    assert result.acc.effects == result.acc.acknowledged


async def test_two_phase_payments_are_charged_once_under_kill_nine(ctx: Context) -> None:
    result = await twophase.two_phase_kills(ctx)
    assert_passed(result, ctx)
    assert result.acc.sent > 0
    assert result.acc.effects == result.acc.acknowledged == result.acc.sent


async def test_broker_outage_delivers_every_row(ctx: Context) -> None:
    assert_passed(await broker.broker_outage(ctx), ctx)


async def test_generated_bad_deliveries(ctx: Context) -> None:
    result = await badinput.bad_webhooks(ctx)
    assert_passed(result, ctx)
    assert sum(n for s, n in result.acc.statuses.items() if s != "200") > 100


async def test_generated_bad_requests(ctx: Context) -> None:
    assert_passed(await badinput.bad_requests(ctx), ctx)


async def test_no_cross_scope_replay_and_admin_refuses(ctx: Context) -> None:
    assert_passed(await security.cross_scope_and_admin(ctx), ctx)


async def test_postgres_restarts_are_survived(ctx: Context) -> None:
    assert_passed(await database.postgres_restarts(ctx), ctx)


async def test_through_pgbouncer_in_transaction_mode(ctx: Context) -> None:
    """The mixed load through a PgBouncer 1.18 of the suite's own (the failover scenarios need a
    pg_auto_failover formation of three servers: `make faults` only)."""
    require_pgbouncer()
    result = await pooler.pgbouncer_load(ctx)
    assert_passed(result, ctx)
    assert result.acc.effects == result.acc.acknowledged


def test_the_proxy_cuts_a_transaction_in_flight(ctx: Context) -> None:
    """The cut the connection scenarios rely on: an open transaction through the proxy fails on
    its next statement, and nothing of it commits."""
    dsn = ctx.database("proxy_check")
    with Proxy(unix_path=ctx.pg.socket) as proxy:
        conn = psycopg.connect(ctx.pg.tcp_dsn(proxy.port, "proxy_check"))
        conn.execute("CREATE TABLE t (x int)")
        conn.commit()
        conn.execute("INSERT INTO t VALUES (1)")
        assert proxy.cut() == 1
        with pytest.raises(psycopg.OperationalError):
            conn.execute("INSERT INTO t VALUES (2)")
            conn.commit()
        conn.close()
    with psycopg.connect(dsn) as check:
        assert check.execute("SELECT count(*) FROM t").fetchone() == (0,)
