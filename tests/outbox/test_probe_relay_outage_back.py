"""A relay loop's outage is one line when it starts and one when it ends, as the other background
loops say it: the database or the broker away, then back. The relay used to report the start
(throttled, once a minute) and never the end, so an operator could not tell from the log whether
it had recovered."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import psycopg
import pytest

from faults.proxy import Proxy
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.brokers import redis_delete
from tests.outbox.conftest import REDIS, fresh, wait_until
from tests.stalling import proxy_to, through

FAST = (timedelta(milliseconds=5), timedelta(milliseconds=50))


def relay_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "pgonce.relay" and r.levelno == level
    ]


async def test_a_database_outage_is_said_once_and_its_end_once(
    direct_dsn: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pgonce.relay")
    kind = fresh("order")
    with proxy_to(direct_dsn) as proxy:
        relay = Relay(
            through(proxy, direct_dsn),
            RedisStreamsPublisher(redis_url),
            listen=False,
            poll_interval=timedelta(milliseconds=20),
            outage_backoff=FAST,
        )
        stop = asyncio.Event()
        running = asyncio.create_task(relay.run(stop))
        try:
            await wait_until(lambda: relay.stats.batches >= 2)
            proxy.refuse(True)
            await wait_until(lambda: relay.stats.errors >= 5)
            with psycopg.connect(direct_dsn) as conn:
                enqueue(conn, kind, "1", "created", {"n": 1})
            proxy.refuse(False)
            await wait_until(lambda: relay.stats.published >= 1)
        finally:
            stop.set()
            await running
    await redis_delete(redis_url, f"outbox.{kind}")
    warnings = relay_lines(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "tries again in" in warnings[0]
    back = [m for m in relay_lines(caplog, logging.INFO) if "answers again" in m]
    assert len(back) == 1, back
    assert back[0].startswith("relay: the database answers again (")
    assert any("the database still fails" in m for m in relay_lines(caplog, logging.DEBUG))


async def test_a_broker_outage_is_said_once_and_its_end_once(
    direct_dsn: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pgonce.relay")
    kind = fresh("order")
    with Proxy(tcp=REDIS) as proxy:
        proxy.refuse(True)
        relay = Relay(
            direct_dsn,
            RedisStreamsPublisher(f"redis://127.0.0.1:{proxy.port}/0"),
            poll_interval=timedelta(milliseconds=20),
            outage_backoff=FAST,
        )
        with psycopg.connect(direct_dsn) as conn:
            enqueue(conn, kind, "1", "created", {"n": 1})
        stop = asyncio.Event()
        running = asyncio.create_task(relay.run(stop))
        try:
            await wait_until(lambda: relay.stats.failures.get("unavailable", 0) >= 4)
            proxy.refuse(False)
            await wait_until(lambda: relay.stats.published >= 1)
        finally:
            stop.set()
            await running
    await redis_delete(redis_url, f"outbox.{kind}")
    down = [m for m in relay_lines(caplog, logging.WARNING) if "is unavailable for" in m]
    assert len(down) == 1, down
    back = [m for m in relay_lines(caplog, logging.INFO) if "answers again" in m]
    assert len(back) == 1, back
    assert back[0].startswith("relay: redis answers again (")
