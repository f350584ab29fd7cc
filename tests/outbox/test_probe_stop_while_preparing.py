"""A relay asked to stop while its publisher checks the broker at the start stops at once.

A broker that accepts connections and does not answer (a stalled host, a half-dead load balancer)
held the check for the publisher's whole connect timeout, and the stop with it: 5 s for RabbitMQ
and NATS, 10 s for Redis. No row is in flight then, so the check is given up.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pgonce.publishers.base import Publisher
from pgonce.publishers.nats import NatsPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from tests.outbox.conftest import wait_until
from tests.outbox.stops import running, silent_server

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
    async with (
        silent_server() as silent,
        running(Relay(direct_dsn, make(silent.port), concurrency=1)) as run,
    ):
        await wait_until(lambda: silent.held)
        await run.stop_within(BOUND, "the relay did not stop while its broker check waited")
