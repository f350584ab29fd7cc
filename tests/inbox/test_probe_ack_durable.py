"""What is acknowledged survives a crash of the server, on a database whose commits do not wait
for their WAL (``synchronous_commit = off``, a setting teams make for throughput, per database or
role). PostgreSQL then answers COMMIT before the commit record is written: the receiver's 200, or
a consumer's ack to its broker, would promise an event the server can still lose, and the
provider (the broker), answered, never sends it again. The server is stopped as a crash would
(``pg_ctl stop -m immediate``), with the WAL writer held back so that nothing else writes the
commit record first."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from pgonce.consumers import IdempotentConsumer, Outcome
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from tests.throwaway import Server, needs_pg_ctl, throwaway_server

pytestmark = needs_pg_ctl

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


async def nothing(event: object, conn: object) -> None:
    return None


@pytest.fixture
def server() -> Iterator[Server]:
    with throwaway_server("pgonce-ack-crash-") as running:
        with psycopg.connect(running.dsn, autocommit=True) as conn:
            conn.execute("ALTER DATABASE postgres SET synchronous_commit = off")
            # The WAL writer writes what commits left in the WAL buffers only every 10 s.
            conn.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
            conn.execute("ALTER SYSTEM SET wal_writer_flush_after = 0")
            conn.execute("SELECT pg_reload_conf()")
            conn.execute("CREATE TABLE shipped (order_id text PRIMARY KEY)")
        yield running


def test_the_setting_holds_for_new_connections(server: Server) -> None:
    with psycopg.connect(server.dsn) as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)


async def test_a_delivery_answered_200_is_still_there_after_a_crash(server: Server) -> None:
    scheme = build_scheme("standard-webhooks", [SECRET])
    source = Source(name="shop", scheme=scheme, handler=nothing)
    body = b'{"type": "order.paid", "order": "o-1"}'
    async with InboxReceiver([source], dsn=server.dsn) as receiver:
        transport = httpx.ASGITransport(app=receiver)
        async with httpx.AsyncClient(transport=transport, base_url="http://hooks") as client:
            answer = await client.post(
                "/webhooks/shop", content=body, headers=scheme.sign(body, event_id="evt_1")
            )
    assert (answer.status_code, answer.json()) == (200, {"outcome": "stored"})
    server.crash()
    server.start()
    with psycopg.connect(server.dsn) as conn:
        stored = conn.execute("SELECT event_id FROM pgonce.inbox").fetchall()
    assert stored == [("evt_1",)]


async def test_a_message_processed_and_acknowledged_is_still_done_after_a_crash(
    server: Server,
) -> None:
    async def ship(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO shipped VALUES ('o-1')")

    consumer = IdempotentConsumer("shipping")
    async with await psycopg.AsyncConnection.connect(server.dsn, autocommit=True) as conn:
        outcome = await consumer.handle(conn, "msg-1", b'{"order": "o-1"}', ship)
        assert outcome is Outcome.PROCESSED  # the broker is acked now
        # The setting is the transaction's own: the connection's next ones keep the role's.
        assert await (await conn.execute("SHOW synchronous_commit")).fetchone() == ("off",)
    server.crash()
    server.start()
    with psycopg.connect(server.dsn) as check:
        shipped = check.execute("SELECT order_id FROM shipped").fetchall()
    assert shipped == [("o-1",)]
    # The broker's redelivery (a retry of its own, or another replica's) is a duplicate.
    async with await psycopg.AsyncConnection.connect(server.dsn, autocommit=True) as conn:
        again = await consumer.handle(conn, "msg-1", b'{"order": "o-1"}', ship)
    assert again is Outcome.DUPLICATE
