"""A RabbitMQ that cannot be reached is reported by the relay once, with what happens next, and
counted at every attempt; aiormq's own error line for each connection it could not make (one per
retry of every batch loop, dozens a minute) is no longer logged beside it."""

from __future__ import annotations

import asyncio
import logging
import socket

import psycopg
import pytest

from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.conftest import wait_until


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_broker_that_refuses_connections_is_reported_once(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(dsn) as conn:
        for n in range(3):
            enqueue(conn, "invoice", str(n), "created", {"n": n})
    publisher = RabbitMQPublisher(f"amqp://guest:guest@127.0.0.1:{closed_port()}/")
    relay = Relay(dsn, publisher)
    caplog.set_level(logging.DEBUG)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        # Three failed attempts at least for each row, each a connection refused.
        await wait_until(lambda: relay.stats.failures.get("unavailable", 0) >= 9, within=60)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert relay.stats.published == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [f"{r.name}: {r.getMessage()}" for r in errors]
    down = [
        r.getMessage()
        for r in caplog.records
        if r.name == "pgonce.relay" and "is unavailable for" in r.getMessage()
    ]
    assert len(down) == 1
    assert "without an attempt counted" in down[0]
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*), max(attempts) FROM pgonce.outbox WHERE published_at IS NULL"
        ).fetchone()
    assert row == (3, 0)
