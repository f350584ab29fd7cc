"""Outbox: relay throughput to RabbitMQ and NATS JetStream, and what enqueue costs a transaction.

References, measured in the same run:
- relay: a raw confirmed-publish loop of the same client library (aio-pika with publisher
  confirms; nats-py ``publish_async`` with PubAcks), publishing the same number of messages in
  batches of the relay's batch size and waiting for every batch's confirms, with no database at
  all (target: the relay at least 70 % of it). And pgonce's own publisher publishing the same
  batches with no database: the relay's limit, so the gap to it is what the claim, the mark and
  the commit per batch cost;
- enqueue: the same business insert alone, one transaction each, on the same connections.

A broker that does not answer is reported as such and its rows are left out; the benchmark never
starts or stops the machine's brokers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import closing
from datetime import UTC, datetime
from functools import partial
from typing import Any, NamedTuple

import aio_pika
import nats
import psycopg
from nats.js.api import StorageType, StreamConfig

from bench.clients import best_alternated, run_clients
from bench.context import BenchContext
from bench.report import Table, ratio
from pgonce.core.outbox import OutboxMessage
from pgonce.publishers.base import Publisher, body, message_headers
from pgonce.publishers.nats import MSG_ID_HEADER, NatsPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher, amqp_message
from pgonce.relay import DEFAULT_BATCH_SIZE, DEFAULT_CONCURRENCY, Relay
from pgonce.store._async.outbox import AsyncOutboxStore

TITLE = "Outbox"
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/"
NATS_URL = "nats://127.0.0.1:4222"
BATCH = DEFAULT_BATCH_SIZE
#: Batches in flight, for the relay (its default concurrency) and for the raw loop alike.
IN_FLIGHT = DEFAULT_CONCURRENCY
#: Events per aggregate in the relay runs: orders get a few events each.
EVENTS_PER_AGGREGATE = 4
PAYLOAD = {"order_id": 0, "amount": 4200, "currency": "EUR", "lines": [{"sku": "A-1", "qty": 2}]}

PublishBatch = Callable[[list[OutboxMessage]], Awaitable[None]]

SETUP = """
CREATE SCHEMA IF NOT EXISTS bench;
CREATE TABLE IF NOT EXISTS bench.outbox_orders (id bigserial PRIMARY KEY, ref text, amount int);
"""


def _answers(port: int) -> bool:
    try:
        with closing(socket.create_connection(("127.0.0.1", port), timeout=1)):
            return True
    except OSError:
        return False


def _reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE pgonce.outbox, pgonce.outbox_aggregates")
        conn.execute(SETUP)


async def _fill(dsn: str, events: int) -> None:
    """Enqueue ``events`` rows (not timed): a few per aggregate, in large transactions."""
    store = AsyncOutboxStore()
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        for n in range(events):
            await store.enqueue(
                conn, "order", str(n // EVENTS_PER_AGGREGATE), "order.created", PAYLOAD
            )
            if n % 2000 == 1999:
                await conn.commit()
        await conn.commit()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("VACUUM ANALYZE pgonce.outbox")


async def _relay_rate(dsn: str, publisher: Publisher, events: int) -> float:
    await asyncio.to_thread(_reset, dsn)
    await _fill(dsn, events)
    relay = Relay(dsn, publisher, batch_size=BATCH, concurrency=IN_FLIGHT, listen=False)
    # Connected to the broker before the clock starts, like the raw loop.
    await publisher.publish([])
    try:
        started = time.perf_counter()
        stats = await relay.drain()
        elapsed = time.perf_counter() - started
    finally:
        await publisher.close()
    if stats.published != events:
        raise RuntimeError(f"the relay published {stats.published} of {events} events")
    return events / elapsed


async def _in_flight(messages: list[OutboxMessage], publish_batch: PublishBatch) -> None:
    """Publish ``messages`` in batches, IN_FLIGHT batches at a time, each awaited whole."""
    batches = [messages[i : i + BATCH] for i in range(0, len(messages), BATCH)]

    async def loop(share: list[list[OutboxMessage]]) -> None:
        for batch in share:
            await publish_batch(batch)

    await asyncio.gather(*(loop(batches[n::IN_FLIGHT]) for n in range(IN_FLIGHT)))


def _messages(events: int) -> list[OutboxMessage]:
    created = datetime.now(UTC)
    # The JSON text the relay reads from jsonb: the same separators, the same length.
    payload = json.dumps(PAYLOAD)
    return [
        OutboxMessage(n, "order", str(n // 4), "order.created", payload, {}, created, 0)
        for n in range(events)
    ]


async def _publisher_rate(publisher: Publisher, events: int) -> float:
    """pgonce's publisher alone: the relay's batches, without the database."""
    messages = _messages(events)

    async def publish_batch(batch: list[OutboxMessage]) -> None:
        result = await publisher.publish(batch)
        if len(result.acked) != len(batch):
            raise RuntimeError(f"the broker acknowledged {len(result.acked)} of {len(batch)}")

    await publisher.publish([])
    try:
        started = time.perf_counter()
        await _in_flight(messages, publish_batch)
        return events / (time.perf_counter() - started)
    finally:
        await publisher.close()


async def _raw_rabbitmq_rate(queue: str, events: int) -> float:
    connection = await aio_pika.connect(RABBITMQ_URL)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = channel.default_exchange
        messages = _messages(events)

        async def publish_batch(batch: list[OutboxMessage]) -> None:
            # The relay's own message shape (body, headers, properties): the comparison is about
            # the relay's database work, not about what goes on the wire.
            await asyncio.gather(
                *(exchange.publish(amqp_message(m), queue, mandatory=True) for m in batch)
            )

        started = time.perf_counter()
        await _in_flight(messages, publish_batch)
        return events / (time.perf_counter() - started)
    finally:
        await connection.close()


async def _raw_nats_rate(subject: str, events: int) -> float:
    client = await nats.connect(NATS_URL)
    try:
        js = client.jetstream()
        messages = _messages(events)

        async def publish_batch(batch: list[OutboxMessage]) -> None:
            futures = [
                await js.publish_async(
                    subject,
                    body(m),
                    headers={**message_headers(m), MSG_ID_HEADER: f"raw-{m.id}"},
                )
                for m in batch
            ]
            await asyncio.gather(*futures)

        started = time.perf_counter()
        await _in_flight(messages, publish_batch)
        return events / (time.perf_counter() - started)
    finally:
        await client.close()


async def _with_rabbitmq_queue(run: Callable[[str], Awaitable[float]]) -> float:
    name = f"pgonce-bench-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(RABBITMQ_URL)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(name, durable=True)
        try:
            return await run(name)
        finally:
            await queue.delete(if_unused=False, if_empty=False)
    finally:
        await connection.close()


async def _with_nats_stream(run: Callable[[str], Awaitable[float]]) -> float:
    name = f"PGONCE_BENCH_{uuid.uuid4().hex[:8]}"
    subject = f"pgonce.bench.{uuid.uuid4().hex[:8]}"
    client = await nats.connect(NATS_URL)
    try:
        js = client.jetstream()
        await js.add_stream(
            StreamConfig(name=name, subjects=[f"{subject}.>"], storage=StorageType.FILE)
        )
        try:
            return await run(subject)
        finally:
            await js.delete_stream(name)
    finally:
        await client.close()


class _Broker(NamedTuple):
    name: str
    port: int
    #: Runs a measurement against a fresh destination (queue, stream subject) and removes it.
    fresh: Callable[[Callable[[str], Awaitable[float]]], Awaitable[float]]
    publisher: Callable[[str], Publisher]
    raw: Callable[[str, int], Awaitable[float]]


BROKERS = (
    _Broker(
        "RabbitMQ (aio-pika, confirms)",
        5672,
        _with_rabbitmq_queue,
        lambda queue: RabbitMQPublisher(RABBITMQ_URL, routing=lambda m: queue),
        _raw_rabbitmq_rate,
    ),
    _Broker(
        "NATS JetStream (nats-py, PubAck)",
        4222,
        _with_nats_stream,
        lambda subject: NatsPublisher(NATS_URL, routing=lambda m: f"{subject}.order"),
        lambda subject, events: _raw_nats_rate(f"{subject}.order", events),
    ),
)


def _relay_table(ctx: BenchContext) -> Table:
    events = ctx.pick(20_000, short=4_000, quick=2_000)
    table = Table(
        f"Outbox relay throughput ({events:,} events, one relay, batches of {BATCH}, "
        f"{IN_FLIGHT} in flight)",
        [
            "broker",
            "relay events/s",
            "raw confirmed loop events/s",
            "relay vs raw",
            "publisher alone events/s",
            "relay vs publisher alone",
        ],
        notes=[
            "Raw loop: the same client library publishing the same messages (body, headers, "
            f"properties) in batches of {BATCH}, {IN_FLIGHT} batches in flight like the relay, "
            "awaiting every batch's confirms (RabbitMQ publisher confirms, JetStream "
            "`publish_async` PubAcks), with no database. It runs before and after the relay; the "
            "better of its two runs is the reference.",
            "Publisher alone: pgonce's publisher sending the same batches with no database, the "
            "relay's own limit. The relay adds claim, mark and commit per batch.",
            "Every run publishes persistent messages to a fresh durable queue or file-backed "
            "stream.",
        ],
    )

    async def measure(broker: _Broker) -> tuple[float, float, float]:
        async def relay_run(destination: str) -> float:
            return await _relay_rate(ctx.dsn, broker.publisher(destination), events)

        async def raw_run(destination: str) -> float:
            return await broker.raw(destination, events)

        async def alone_run(destination: str) -> float:
            return await _publisher_rate(broker.publisher(destination), events)

        raw = await broker.fresh(raw_run)
        alone = await broker.fresh(alone_run)
        relay = await broker.fresh(relay_run)
        raw = max(raw, await broker.fresh(raw_run))
        return relay, raw, max(alone, await broker.fresh(alone_run))

    for broker in BROKERS:
        if not _answers(broker.port):
            table.add(broker.name, "not answering on port", broker.port, "-", "-", "-")
            continue
        relay_rate, raw_rate, alone_rate = asyncio.run(measure(broker))
        table.add(
            broker.name,
            f"{relay_rate:,.0f}",
            f"{raw_rate:,.0f}",
            ratio(relay_rate, raw_rate, "raw"),
            f"{alone_rate:,.0f}",
            ratio(relay_rate, alone_rate, "publisher alone"),
        )
    _reset(ctx.dsn)
    return table


async def _insert_alone(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO bench.outbox_orders (ref, amount) VALUES (%s, 4200)", (f"{client}-{seq}",)
        )


_STORE = AsyncOutboxStore()


async def _insert_and_enqueue(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
    async with conn.transaction():
        ref = f"{client}-{seq}"
        await conn.execute(
            "INSERT INTO bench.outbox_orders (ref, amount) VALUES (%s, 4200)", (ref,)
        )
        await _STORE.enqueue(conn, "order", ref, "order.created", PAYLOAD)


def _enqueue_table(ctx: BenchContext) -> Table:
    seconds = ctx.seconds(6)
    table = Table(
        "Outbox enqueue overhead on the business transaction",
        [
            "clients",
            "insert alone tx/s",
            "insert + enqueue tx/s",
            "throughput",
            "p99 alone",
            "p99 with enqueue",
        ],
        notes=[
            "Each transaction: BEGIN; INSERT the business row; [enqueue one event]; COMMIT. "
            "Two alternating rounds of each, the better one reported. Every "
            "event has its own aggregate (one order each), so no enqueue waits for another.",
            "enqueue is one statement: the aggregate's lock row, the outbox row and the NOTIFY.",
        ],
    )
    _reset(ctx.dsn)
    for clients in (1, 8):
        alone, both = best_alternated(
            partial(run_clients, ctx.dsn, clients, seconds / 2, _insert_alone),
            partial(run_clients, ctx.dsn, clients, seconds / 2, _insert_and_enqueue),
        )
        table.add(
            clients,
            f"{alone.tps:,.0f}",
            f"{both.tps:,.0f}",
            ratio(both.tps, alone.tps, "insert alone"),
            f"{alone.p99_ms:.2f} ms",
            f"{both.p99_ms:.2f} ms",
        )
    _reset(ctx.dsn)
    return table


def run(ctx: BenchContext) -> list[Table]:
    return [_relay_table(ctx), _enqueue_table(ctx)]
