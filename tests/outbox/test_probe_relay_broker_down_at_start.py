"""A relay that starts while its broker (Redis) is down reports the outage once: the check at
the start is the outage's first report, and the batches that then find the broker away are the
same outage, not a second warning."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import psycopg
import pytest

from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.conftest import free_port, wait_until


async def test_a_broker_down_at_start_is_one_warning(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pgonce.relay")
    with psycopg.connect(direct_dsn, autocommit=True) as conn, conn.transaction():
        enqueue(conn, "order", "1", "created", {"n": 1})
    publisher = RedisStreamsPublisher(f"redis://127.0.0.1:{free_port()}/0")
    relay = Relay(
        direct_dsn,
        publisher,
        concurrency=1,
        listen=False,
        poll_interval=timedelta(milliseconds=50),
        outage_backoff=(timedelta(milliseconds=20), timedelta(milliseconds=50)),
    )
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_until(lambda: relay.stats.failures.get("unavailable", 0) >= 3, within=30)
    finally:
        stop.set()
        await running

    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "Redis" in warnings[0], warnings
