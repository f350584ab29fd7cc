"""Failures pinned to one row, on the real brokers and PostgreSQL: a routing function that raises
for a row, and a RabbitMQ message above the broker's max_message_size. Each is a refusal of that
row (an attempt counted, parked in the end), never a failure of the whole batch that would stop
every aggregate behind it."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce.core.outbox import OutboxMessage, RetryPolicy
from pgonce.publishers.http import HttpPublisher
from pgonce.publishers.nats import NatsPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.brokers import (
    nats_read,
    nats_stream,
    rabbitmq_drain,
    rabbitmq_queue,
    redis_delete,
    redis_read,
)
from tests.outbox.conftest import Receiver, fresh, wait_until
from tests.outbox.test_poison_rows import PARK_AT_ONCE, SECRET, first_batch_then_drain, rows

#: What the rows carry: it must never show in a refusal's reason or in the log.
SECRET_PAYLOAD = {"card": "4111-1111-SECRET"}
#: The broker's max_message_size: RabbitMQ's default from 3.8 to 3.13, which the test broker
#: keeps (``rabbitmqctl environment``).
BROKER_MAX_MESSAGE_SIZE = 128 * 1024 * 1024


def routing_to(destination: str) -> Any:
    """A routing function that knows every event type but ``unknown``."""

    def route(message: OutboxMessage) -> str:
        if message.type == "unknown":
            raise LookupError(f"no destination for events of type {message.type!r}")
        return destination

    return route


def poison_and_others(dsn: str, aggregatetype: str) -> tuple[int, int, int]:
    """A row the routing raises for, the row of its aggregate behind it, another aggregate's."""
    with psycopg.connect(dsn) as conn:
        bad = enqueue(conn, aggregatetype, "1", "unknown", SECRET_PAYLOAD)
        behind = enqueue(conn, aggregatetype, "1", "e", {"n": 2})
        other = enqueue(conn, aggregatetype, "2", "e", {"n": 3})
        conn.commit()
    return bad, behind, other


def assert_refused_for_the_routing(error: str) -> None:
    assert "routing function raised LookupError: no destination for" in error
    assert "SECRET" not in error


async def test_a_routing_function_that_raises_parks_its_row_and_the_relay_goes_on(
    dsn: str, rabbitmq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue_name = fresh("pgonce-test-")
    bad, behind, other = poison_and_others(dsn, queue_name)
    policy = RetryPolicy(
        max_attempts=3, base=timedelta(milliseconds=20), cap=timedelta(milliseconds=40)
    )
    async with rabbitmq_queue(rabbitmq_url, queue_name) as queue:
        relay = Relay(
            dsn,
            RabbitMQPublisher(rabbitmq_url, routing=routing_to(queue_name)),
            policy=policy,
            listen=False,
            poll_interval=timedelta(milliseconds=20),
        )
        stop = asyncio.Event()
        with caplog.at_level(logging.WARNING, logger="pgonce.relay"):
            running = asyncio.create_task(relay.run(stop))
            try:
                # The other aggregate goes at once; the bad row is refused at every attempt and
                # parked after the third, and then the row behind it goes too.
                await wait_until(lambda: rows(dsn)[behind][0] and rows(dsn)[other][0])
            finally:
                stop.set()
                await running
        received = await rabbitmq_drain(queue)
    published, parked, attempts, error = rows(dsn)[bad]
    assert (published, parked, attempts) == (False, True, 3)
    assert_refused_for_the_routing(error)
    assert sorted(int(r.message_id) for r in received) == [behind, other]
    assert relay.stats.errors == 0
    assert relay.stats.failures == {"routing_failed": 3}
    lines = [r.getMessage() for r in caplog.records if "routing_failed" in r.getMessage()]
    # Once for the attempts (the second one held back), once for the parking.
    assert len(lines) == 2
    assert "parked after 3 attempts" in lines[1]
    assert not any("SECRET" in r.getMessage() for r in caplog.records)


async def test_a_routing_function_that_raises_is_a_refusal_on_nats(dsn: str, nats_url: str) -> None:
    stream = fresh("PGONCE_TEST_")
    subject = fresh("pgonce.test.")
    bad, behind, other = poison_and_others(dsn, "order")
    async with nats_stream(nats_url, stream, [subject]) as js:
        relay = Relay(
            dsn, NatsPublisher(nats_url, routing=routing_to(subject)), policy=PARK_AT_ONCE
        )
        after_first = await first_batch_then_drain(relay, dsn)
        received = await nats_read(js, stream)
    assert after_first[bad][:3] == (False, True, 1)
    assert_refused_for_the_routing(after_first[bad][3])
    # The other aggregate went in the same batch; the row behind waited for the bad one.
    assert after_first[other][0] is True
    assert after_first[behind][:2] == (False, False)
    assert [int(r.message_id) for r in received] == [other, behind]


async def test_a_routing_function_that_raises_is_a_refusal_on_redis(
    dsn: str, redis_url: str
) -> None:
    key = fresh("pgonce.test.")
    bad, behind, other = poison_and_others(dsn, "order")
    relay = Relay(
        dsn, RedisStreamsPublisher(redis_url, routing=routing_to(key)), policy=PARK_AT_ONCE
    )
    try:
        after_first = await first_batch_then_drain(relay, dsn)
        received = await redis_read(redis_url, key)
    finally:
        await redis_delete(redis_url, key)
    assert after_first[bad][:3] == (False, True, 1)
    assert_refused_for_the_routing(after_first[bad][3])
    assert after_first[other][0] is True
    assert after_first[behind][:2] == (False, False)
    assert [int(r.message_id) for r in received] == [other, behind]


async def test_a_routing_function_that_raises_is_a_refusal_for_webhooks(
    dsn: str, receiver: Receiver
) -> None:
    bad, behind, other = poison_and_others(dsn, "order")
    publisher = HttpPublisher(routing=routing_to(receiver.url), secret=SECRET)
    relay = Relay(dsn, publisher, policy=PARK_AT_ONCE)
    after_first = await first_batch_then_drain(relay, dsn)
    assert after_first[bad][:3] == (False, True, 1)
    assert_refused_for_the_routing(after_first[bad][3])
    assert after_first[other][0] is True
    assert after_first[behind][:2] == (False, False)
    assert [int(h["webhook-id"]) for h, _ in receiver.requests] == [other, behind]


@pytest.mark.parametrize("destination", [None, 42])
async def test_a_routing_function_that_returns_no_name_is_a_refusal(
    rabbitmq_url: str, nats_url: str, destination: object
) -> None:
    bad = OutboxMessage(1, "order", "1", "e", "{}", {}, datetime.now(UTC), 0)
    for publisher in (
        RabbitMQPublisher(rabbitmq_url, routing=lambda m: destination),  # type: ignore[arg-type]
        NatsPublisher(nats_url, routing=lambda m: destination),  # type: ignore[arg-type]
        HttpPublisher(routing=lambda m: destination, secret=SECRET),  # type: ignore[arg-type]
    ):
        try:
            result = await publisher.publish([bad])
        finally:
            await publisher.close()
        assert result.lost is None
        assert f"returned {type(destination).__name__}, not a str" in result.refused[1]


async def test_a_body_above_rabbitmq_max_message_size_is_refused_and_the_rest_goes_on(
    dsn: str, rabbitmq_url: str
) -> None:
    # The broker's own limit (RabbitMQ's default, 128 MiB here) and a publisher that believes
    # it higher (the most RabbitMQ allows): the body reaches the broker, which closes the
    # channel with 406 PRECONDITION_FAILED. Taken for a lost connection, the row would stay
    # unsettled and every batch would stop at it for ever.
    queue_name = fresh("pgonce-test-")
    with psycopg.connect(dsn) as conn:
        before = enqueue(conn, queue_name, "2", "e", {"n": 0})
        big = enqueue(conn, queue_name, "1", "e", "x" * BROKER_MAX_MESSAGE_SIZE)
        behind = enqueue(conn, queue_name, "1", "e", {"n": 2})
        other = enqueue(conn, queue_name, "3", "e", {"n": 3})
        conn.commit()
    publisher = RabbitMQPublisher(rabbitmq_url, max_message_size=512 * 1024 * 1024)
    async with rabbitmq_queue(rabbitmq_url, queue_name) as queue:
        relay = Relay(dsn, publisher, policy=PARK_AT_ONCE)
        after_first = await first_batch_then_drain(relay, dsn)
        received = await rabbitmq_drain(queue)
    published, parked, attempts, error = after_first[big]
    assert (published, parked, attempts) == (False, True, 1)
    assert f"max_message_size of {BROKER_MAX_MESSAGE_SIZE} bytes" in error
    # The rows sent after it on the closed channel were unsettled, not refused: they went in
    # the next batch, on a channel opened afresh.
    assert after_first[behind][:3] == (False, False, 0)
    assert after_first[other][2] == 0
    assert {int(r.message_id) for r in received} == {before, behind, other}
    after = rows(dsn)
    assert all(after[row][0] for row in (before, behind, other))
    # The publisher learnt the broker's limit: the next such row is refused before it is sent.
    assert publisher.max_message_size == BROKER_MAX_MESSAGE_SIZE


async def test_a_body_above_the_configured_max_message_size_is_refused_before_it_is_sent(
    rabbitmq_url: str,
) -> None:
    queue_name = fresh("pgonce-test-")
    now = datetime.now(UTC)
    big = OutboxMessage(1, queue_name, "1", "e", '"' + "x" * 2000 + '"', {}, now, 0)
    behind = OutboxMessage(2, queue_name, "1", "e", "{}", {}, now, 0)
    other = OutboxMessage(3, queue_name, "2", "e", "{}", {}, now, 0)
    async with rabbitmq_queue(rabbitmq_url, queue_name) as queue:
        publisher = RabbitMQPublisher(rabbitmq_url, max_message_size=1024)
        try:
            result = await publisher.publish([big, behind, other])
        finally:
            await publisher.close()
        received = await rabbitmq_drain(queue)
    assert result.lost is None
    assert "body of 2002 bytes is above the broker's max_message_size of 1024" in result.refused[1]
    assert result.kinds[1] == "too_large"
    assert result.acked == {3}
    assert [r.message_id for r in received] == ["3"]
