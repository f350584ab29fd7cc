"""The idempotent-consumer helper on real PostgreSQL, and the RabbitMQ example end to end: a
message delivered twice has its effect once, and is acknowledged only after the commit."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce.consumers import IdempotentConsumer, Outcome
from pgonce.core.fingerprint import fingerprint
from pgonce.core.outbox import OutboxMessage
from pgonce.errors import KeyMismatch, UsageError
from pgonce.publishers.nats import NatsPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.store._async.keys import AsyncKeyStore
from pgonce.store._sync.outbox import enqueue
from tests.outbox.brokers import nats_stream, rabbitmq_queue, redis_delete
from tests.outbox.conftest import fresh
from tests.outbox.processes import ROOT


async def effects(conn: psycopg.AsyncConnection[Any]) -> list[str]:
    cur = await conn.execute("SELECT message_id FROM effects ORDER BY message_id")
    return [r[0] for r in await cur.fetchall()]


@pytest.fixture
async def db(dsn: str) -> Any:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("CREATE TABLE effects (message_id text PRIMARY KEY)")
        yield conn


def recorder(message_id: str) -> Any:
    async def record(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects VALUES (%s)", (message_id,))

    return record


async def test_a_redelivered_message_runs_the_handler_once(db: Any) -> None:
    consumer = IdempotentConsumer("shipping")
    first = await consumer.handle(db, "41", b"{}", recorder("41"))
    again = await consumer.handle(db, "41", b"{}", recorder("41"))
    assert (first, again) == (Outcome.PROCESSED, Outcome.DUPLICATE)
    assert first.acknowledge
    assert again.acknowledge
    assert await effects(db) == ["41"]
    # Another consumer of the same message is another scope: it runs its own handler.
    assert await IdempotentConsumer("billing").handle(db, "41", b"{}", _nothing) == (
        Outcome.PROCESSED
    )


async def _nothing(conn: psycopg.AsyncConnection[Any]) -> None:
    return None


async def test_a_failing_handler_leaves_no_claim_and_no_effect(db: Any) -> None:
    consumer = IdempotentConsumer("shipping")

    async def fail(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects VALUES ('42')")
        raise RuntimeError("downstream is down")

    with pytest.raises(RuntimeError):
        await consumer.handle(db, "42", b"{}", fail)
    assert await effects(db) == []
    assert await consumer.handle(db, "42", b"{}", recorder("42")) == Outcome.PROCESSED
    assert await effects(db) == ["42"]


async def test_a_message_being_processed_elsewhere_is_in_flight(dsn: str, db: Any) -> None:
    store = AsyncKeyStore(wait=timedelta(milliseconds=100))
    async with await psycopg.AsyncConnection.connect(dsn) as other:
        # Another replica has claimed the message and is still working on it.
        await store.claim(other, "shipping", "43", fingerprint(b"{}"))
        outcome = await IdempotentConsumer("shipping", key_store=store).handle(
            db, "43", b"{}", recorder("43")
        )
        assert outcome is Outcome.IN_FLIGHT
        assert not outcome.acknowledge
        await other.rollback()
    assert await effects(db) == []


async def test_same_id_other_body_and_an_open_transaction_are_refused(dsn: str, db: Any) -> None:
    consumer = IdempotentConsumer("shipping")
    await consumer.handle(db, "44", b'{"a":1}', _nothing)
    with pytest.raises(KeyMismatch):
        await consumer.handle(db, "44", b'{"a":2}', _nothing)
    async with await psycopg.AsyncConnection.connect(dsn) as busy:
        await busy.execute("SELECT 1")
        with pytest.raises(UsageError):
            await consumer.handle(busy, "45", b"{}", _nothing)


async def test_rabbitmq_example_consumer_ships_each_order_once(dsn: str, rabbitmq_url: str) -> None:
    name = fresh("pgonce-test-")
    with psycopg.connect(dsn) as conn:
        for order in range(5):
            enqueue(conn, "order", str(order), "order.created", {"order_id": order})
        conn.commit()
    async with rabbitmq_queue(rabbitmq_url, name):
        publisher = RabbitMQPublisher(rabbitmq_url, routing=lambda m: name)
        # Every message is on the queue twice: a relay published, died before marking, and the
        # next relay published again.
        relay = Relay(dsn, publisher)
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            batch = await relay.store.claim(conn, limit=10)
            await publisher.publish(batch)
            await conn.rollback()
        await relay.drain()
        await publisher.close()
        example = await asyncio.create_subprocess_exec(
            sys.executable,
            str(ROOT / "examples" / "consumers" / "rabbitmq.py"),
            "--dsn",
            dsn,
            "--url",
            rabbitmq_url,
            "--queue",
            name,
            "--stop-after",
            "10",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(example.communicate(), timeout=60)
        assert example.returncode == 0
    outcomes = Counter(line.split(": ")[1] for line in out.decode().splitlines())
    assert outcomes == {"processed": 5, "duplicate": 5}
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SELECT order_id FROM shipments ORDER BY order_id")
        assert [r[0] for r in await cur.fetchall()] == ["0", "1", "2", "3", "4"]


async def run_example(script: str, *args: str) -> Counter[str]:
    example = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / "consumers" / script),
        *args,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(example.communicate(), timeout=60)
    assert example.returncode == 0
    return Counter(line.split(": ")[1] for line in out.decode().splitlines())


def orders(count: int) -> list[OutboxMessage]:
    now = datetime.now(UTC)
    return [
        OutboxMessage(100 + n, "order", str(n), "order.created", f'{{"order_id": {n}}}', {}, now, 0)
        for n in range(count)
    ]


async def test_redis_example_consumer_acknowledges_a_republished_entry_as_duplicate(
    dsn: str, redis_url: str
) -> None:
    key = fresh("pgonce-test-")
    publisher = RedisStreamsPublisher(redis_url, routing=lambda m: key)
    try:
        # Redis has no publish dedupe: a republished batch is a second set of entries.
        await publisher.publish(orders(3))
        await publisher.publish(orders(3))
        outcomes = await run_example(
            "redis_streams.py",
            "--dsn",
            dsn,
            "--url",
            redis_url,
            "--stream",
            key,
            "--stop-after",
            "6",
        )
    finally:
        await publisher.close()
        await redis_delete(redis_url, key)
    assert outcomes == {"processed": 3, "duplicate": 3}


async def test_nats_example_consumer_processes_each_message_once(dsn: str, nats_url: str) -> None:
    stream = fresh("PGONCE_TEST_")
    subject = fresh("pgonce.test.")
    async with nats_stream(nats_url, stream, [subject]):
        publisher = NatsPublisher(nats_url, routing=lambda m: subject)
        try:
            await publisher.publish(orders(3))
            await publisher.publish(orders(3))  # dropped by JetStream: same Nats-Msg-Id
        finally:
            await publisher.close()
        outcomes = await run_example(
            "nats_jetstream.py",
            "--dsn",
            dsn,
            "--url",
            nats_url,
            "--stream",
            stream,
            "--subject",
            subject,
            "--stop-after",
            "3",
        )
    assert outcomes == {"processed": 3}
