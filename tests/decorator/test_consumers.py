"""``@idempotent`` with a real broker (RabbitMQ): a message handler whose effect happens once.

Two ways, both acknowledging only after the commit: the decorated handler inside the idempotent
consumer helper (the message id dedupes redeliveries, the decorator dedupes the business key
across messages), and the decorated callback on its own with ``commit=True``.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import aio_pika
import psycopg
import pytest

from pgonce import KeyInFlight, idempotent
from pgonce.consumers import IdempotentConsumer, Outcome
from tests.outbox.brokers import rabbitmq_queue
from tests.outbox.conftest import fresh

pytestmark = pytest.mark.usefixtures("shipments")


@pytest.fixture
def shipments(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE shipments (order_id text NOT NULL, message_id text NOT NULL)")


# The order is what must happen once; which message carried it is not part of the identity.
@idempotent(key="order_id", payload="order_id", scope="shipping-orders")
async def ship(conn: psycopg.AsyncConnection[Any], order_id: str, message_id: str) -> str:
    await conn.execute("INSERT INTO shipments VALUES (%s, %s)", (order_id, message_id))
    return f"shipment of {order_id}"


async def publish(url: str, queue: str, messages: list[tuple[str, dict[str, Any]]]) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        for message_id, body in messages:
            await channel.default_exchange.publish(
                aio_pika.Message(json.dumps(body).encode(), message_id=message_id),
                routing_key=queue,
            )


async def consume(url: str, queue: str, count: int, handle: Any) -> list[str]:
    """Take ``count`` messages, hand each to ``handle``; acknowledge what it says may be."""
    seen: list[str] = []
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1)
        declared = await channel.declare_queue(queue, passive=True)
        async with declared.iterator() as messages:
            async for message in messages:
                seen.append(await handle(message))
                if len(seen) == count:
                    break
    return seen


async def rows(dsn: str) -> list[tuple[str, str]]:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SELECT order_id, message_id FROM shipments")
        return [(r[0], r[1]) for r in await cur.fetchall()]


async def test_inside_the_consumer_helper_one_shipment_per_order(
    dsn: str, rabbitmq_url: str
) -> None:
    queue = fresh("pgonce-test-")
    consumer = IdempotentConsumer("shipping")
    async with rabbitmq_queue(rabbitmq_url, queue):
        # m-1 redelivered (the producer's relay published it twice), and m-2: the same order
        # re-emitted under a new message id.
        await publish(
            rabbitmq_url,
            queue,
            [("m-1", {"order": "7"}), ("m-1", {"order": "7"}), ("m-2", {"order": "7"})],
        )
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as db:

            async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> str:
                order = json.loads(message.body)["order"]
                mid = str(message.message_id)

                # The decorated function joins the consumer's transaction (its claim is a
                # savepoint in it): message claim, order claim and shipment commit together.
                async def handler(conn: psycopg.AsyncConnection[Any]) -> None:
                    await ship(conn, order, mid)

                outcome = await consumer.handle(db, mid, message.body, handler)
                if outcome.acknowledge:
                    await message.ack()
                else:
                    await message.nack(requeue=True)
                return outcome.value

            outcomes = await consume(rabbitmq_url, queue, 3, handle)
    assert Counter(outcomes) == {Outcome.PROCESSED.value: 2, Outcome.DUPLICATE.value: 1}
    assert await rows(dsn) == [("7", "m-1")]


async def test_a_decorated_callback_commits_before_the_acknowledgement(
    dsn: str, rabbitmq_url: str
) -> None:

    @idempotent(
        key=lambda conn, message: str(message.message_id),
        payload=lambda conn, message: message.body,  # not the delivery tag or redelivered flag
        scope="shipping-callback",
        commit=True,
    )
    async def on_message(
        conn: psycopg.AsyncConnection[Any], message: aio_pika.abc.AbstractIncomingMessage
    ) -> str:
        order = str(json.loads(message.body)["order"])
        await conn.execute("INSERT INTO shipments VALUES (%s, %s)", (order, message.message_id))
        return order

    queue = fresh("pgonce-test-")
    async with rabbitmq_queue(rabbitmq_url, queue):
        await publish(rabbitmq_url, queue, [("m-3", {"order": "8"}), ("m-3", {"order": "8"})])
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as db:

            async def handle(message: aio_pika.abc.AbstractIncomingMessage) -> str:
                try:
                    order = await on_message(db, message)
                except KeyInFlight:
                    await message.nack(requeue=True)
                    return "in flight"
                await message.ack()  # the shipment and the claim committed before this
                return order

            assert await consume(rabbitmq_url, queue, 2, handle) == ["8", "8"]
    assert await rows(dsn) == [("8", "m-3")]
