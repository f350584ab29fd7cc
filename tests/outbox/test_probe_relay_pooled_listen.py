"""A relay whose LISTEN goes through PgBouncer in transaction mode notices that no notification
reaches it, says so once, and polls without registering as waiting.

LISTEN runs through the pooler, and the server session that ran it goes back to the pool: nothing
it is notified of reaches the relay. The relay used to wait on that connection in silence, woken
only by its poll, while registering as a waiting relay at every sleep, so that every enqueue()
sent a NOTIFY (which serializes the producers' commits) that no one received.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from datetime import timedelta

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgonce.core.outbox import OutboxMessage
from pgonce.publishers.base import PublishResult
from pgonce.relay import Relay
from tests.outbox.conftest import wait_until


class Acking:
    name = "acking"

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        return PublishResult(acked=frozenset(m.id for m in batch))

    async def close(self) -> None:
        pass


def registrations(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pgonce.outbox_waiting_relays").fetchone()
    return int(row[0]) if row else 0


async def test_a_relay_listening_through_a_transaction_pooler_says_so_and_polls(
    direct_dsn: str, pgbouncer_server_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    pooled = make_conninfo(pgbouncer_server_dsn, dbname=conninfo_to_dict(direct_dsn)["dbname"])
    relay = Relay(pooled, Acking(), concurrency=1, poll_interval=timedelta(milliseconds=100))

    def said() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "pgonce.relay" and "received no notification" in r.getMessage()
        ]

    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_until(said, within=30)
        # Polling goes on, with no relay registered as waiting for a notification.
        batches = relay.stats.batches
        await wait_until(lambda: relay.stats.batches >= batches + 5)
        assert registrations(direct_dsn) == 0
    finally:
        stop.set()
        await running
    (line,) = said()
    assert "polls every 0.1 s instead" in line
    assert "listen_dsn" in line
    assert "postgres@" not in line


async def test_a_relay_listening_directly_keeps_being_woken(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    relay = Relay(direct_dsn, Acking(), concurrency=1)
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_until(lambda: registrations(direct_dsn) >= 1)
    finally:
        stop.set()
        await running
    assert not [r for r in caplog.records if "received no notification" in r.getMessage()]
