"""A relay asked to stop while its publisher checks the broker at the start stops at once.

A broker that accepts connections and does not answer (a stalled host, a half-dead load balancer)
held the check for the publisher's whole connect timeout, and the stop with it: 5 s for RabbitMQ
and NATS, 10 s for Redis. No row is in flight then, so the check is given up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from pgonce.publishers.base import Publisher
from pgonce.publishers.nats import NatsPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from tests.outbox.conftest import wait_until

#: Well below the publishers' connect timeouts (5 s and more), well above a prompt stop.
BOUND = 3


def rabbitmq(port: int) -> Publisher:
    return RabbitMQPublisher(f"amqp://guest:guest@127.0.0.1:{port}/")


def nats(port: int) -> Publisher:
    return NatsPublisher(f"nats://127.0.0.1:{port}")


def redis(port: int) -> Publisher:
    return RedisStreamsPublisher(f"redis://127.0.0.1:{port}/0")


@pytest.mark.parametrize("make", [rabbitmq, nats, redis])
async def test_stop_ends_a_relay_whose_broker_does_not_answer_its_check(
    direct_dsn: str, make: Callable[[int], Publisher]
) -> None:
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # accepted, never answered

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    relay = Relay(direct_dsn, make(port), concurrency=1)
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_until(lambda: held)
        stop.set()
        done, _ = await asyncio.wait({running}, timeout=BOUND)
        assert running in done, "the relay did not stop while its broker check waited"
        running.result()
    finally:
        if not running.done():
            running.cancel()
            await asyncio.wait({running})
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
