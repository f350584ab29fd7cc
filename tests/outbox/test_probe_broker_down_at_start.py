"""A Redis or NATS server that cannot be reached when the relay starts is said at the start, as
the RabbitMQ publisher says it, before any row: a relay started against a wrong address or a
broker that is down used to be silent until the first event, possibly hours later."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from pgonce.publishers.base import Publisher
from pgonce.publishers.nats import NatsPublisher
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from tests.outbox.conftest import free_port, wait_until


def redis(port: int) -> Publisher:
    return RedisStreamsPublisher(f"redis://127.0.0.1:{port}/0")


def nats(port: int) -> Publisher:
    return NatsPublisher(f"nats://127.0.0.1:{port}")


@pytest.mark.parametrize(("make", "said"), [(redis, "Redis:"), (nats, "NATS:")])
async def test_a_broker_that_is_down_is_said_at_the_start_before_any_row(
    dsn: str, caplog: pytest.LogCaptureFixture, make: Callable[[int], Publisher], said: str
) -> None:
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    relay = Relay(dsn, make(free_port()))

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "pgonce.relay"]

    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_until(lambda: any("the rows wait until it is fixed" in m for m in lines()))
    finally:
        stop.set()
        await running
    (line,) = [m for m in lines() if "the rows wait until it is fixed" in m]
    assert said in line
    assert relay.stats.batches == 0 or relay.stats.published == 0


async def test_a_redis_database_the_server_lacks_is_said_at_the_start(
    dsn: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    relay = Relay(dsn, RedisStreamsPublisher(redis_url.rsplit("/", 1)[0] + "/9999"))
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))

    def said() -> bool:
        return any(
            "DB index is out of range" in r.getMessage()
            and "wait until it is fixed" in r.getMessage()
            for r in caplog.records
        )

    try:
        await wait_until(said)
    finally:
        stop.set()
        await running
