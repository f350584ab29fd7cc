"""The outbox relay behind PgBouncer in ``pool_mode = statement``, and behind a PgBouncer that is
killed, restarted or told to drop its server connections while the relay runs.

Every batch is a transaction, which statement mode refuses at its BEGIN. The relay used to say
"the database still fails", as for an outage, and wait for it to end: the operator looked for a
database that was down, when it is the pool mode that has to change. A claim of the key store
meeting the same refusal raises a ConfigError that names the pool modes that work; the relay now
says the same, and goes on trying (the pooler may be reconfigured without restarting the relay).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import timedelta

import psycopg
import pytest

from pgonce import KeyStore, Response, Won, fingerprint
from pgonce.core.outbox import OutboxMessage
from pgonce.errors import DatabaseUnavailable
from pgonce.publishers.base import PublishResult
from pgonce.relay import Relay
from pgonce.store._async.outbox import enqueue
from tests.outbox.conftest import wait_until
from tests.outbox.test_probe_relay_pooled_listen import Acking
from tests.pgbouncer import admin, started_pgbouncer, through

FP = fingerprint("pooled")


def _database(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


async def test_a_relay_behind_statement_pooling_names_the_pool_modes_that_work(
    direct_dsn: str, server_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    with started_pgbouncer(server_dsn, pool_size=2, pool_mode="statement") as bouncer:
        relay = Relay(
            through(bouncer, direct_dsn),
            Acking(),
            concurrency=1,
            listen_dsn=direct_dsn,
            outage_backoff=(timedelta(milliseconds=50), timedelta(milliseconds=100)),
        )
        stop = asyncio.Event()
        running = asyncio.create_task(relay.run(stop))
        try:
            await wait_until(lambda: relay.stats.errors >= 4, within=30)
        finally:
            stop.set()
            await running
    said = [r for r in caplog.records if "statement pooling mode" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]  # once for the run of failures
    assert "pool_mode = transaction" in said[0].getMessage()
    assert "the database" not in said[0].getMessage()
    assert "tries again" in said[0].getMessage()


def marked(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pgonce.outbox WHERE published_at IS NOT NULL"
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("how", ["KILL", "restart"])
def test_a_claim_open_when_pgbouncer_drops_its_connection_frees_the_key(
    direct_dsn: str, server_dsn: str, how: str
) -> None:
    # The server session is closed under the open transaction: it rolled back, so the client
    # gets DatabaseUnavailable (a 503 that it retries) and its retry wins the key once.
    store = KeyStore()
    with started_pgbouncer(server_dsn, pool_size=2) as bouncer:
        dsn = through(bouncer, direct_dsn)
        with psycopg.connect(dsn, prepare_threshold=None) as conn:
            claim = store.begin(conn, "s", "k", FP)
            assert isinstance(claim, Won)
            if how == "KILL":
                admin(bouncer, f"KILL {_database(direct_dsn)}")
            else:
                bouncer.stop()
                bouncer.start()
            with pytest.raises(DatabaseUnavailable):
                store.commit(conn, claim, Response(201))
        if how == "KILL":
            admin(bouncer, f"RESUME {_database(direct_dsn)}")
        with psycopg.connect(dsn, prepare_threshold=None) as conn:
            retry = store.begin(conn, "s", "k", FP)
            assert isinstance(retry, Won)
            assert store.commit(conn, retry, Response(201))


async def test_a_relay_outlives_pgbouncer_killing_its_connections_and_restarting(
    direct_dsn: str, server_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Each drop of the relay's connections is one line with what happens next, and one when
    # batches run again; every row is published once, through both.
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    published: list[int] = []

    class Recording(Acking):
        async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
            published.extend(m.id for m in batch)
            return await super().publish(batch)

    async def enqueued(n: int) -> None:
        async with await psycopg.AsyncConnection.connect(direct_dsn) as conn:
            await enqueue(conn, "order", str(n), "created", {"n": n})
        # Marked, not only sent: a drop before the mark commits publishes the row again (with
        # the same message id), as the relay's guarantee says.
        await wait_until(lambda: marked(direct_dsn) >= n, within=30)

    with started_pgbouncer(server_dsn, pool_size=4) as bouncer:
        relay = Relay(
            through(bouncer, direct_dsn),
            Recording(),
            concurrency=1,
            listen_dsn=direct_dsn,
            poll_interval=timedelta(milliseconds=200),
            outage_backoff=(timedelta(milliseconds=50), timedelta(milliseconds=200)),
        )
        stop = asyncio.Event()
        running = asyncio.create_task(relay.run(stop))
        try:
            await enqueued(1)
            await asyncio.to_thread(admin, bouncer, f"KILL {_database(direct_dsn)}")
            await asyncio.to_thread(admin, bouncer, f"RESUME {_database(direct_dsn)}")
            await enqueued(2)
            await asyncio.to_thread(bouncer.stop)
            await asyncio.to_thread(bouncer.start)
            await enqueued(3)
        finally:
            stop.set()
            await running
    assert sorted(published) == sorted(set(published))
    assert len(published) == 3
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "pgonce.relay" and r.levelno >= logging.WARNING
    ]
    assert all("tries again" in line for line in lines), lines
    assert len(lines) <= 2 * 2  # at most one per drop for each of the two loops' runs
    back = [r for r in caplog.records if "the database answers again" in r.getMessage()]
    assert len(back) == len(lines)
