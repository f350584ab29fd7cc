"""Outbox: relay throughput to RabbitMQ and NATS JetStream, and what enqueue costs a transaction.

References, measured in the same run:
- relay: a raw confirmed-publish loop of the same client library (aio-pika with publisher
  confirms; nats-py ``publish_async`` with PubAcks), publishing the same number of messages in
  batches of the relay's batch size and waiting for every batch's confirms, with no database at
  all (target: the relay at least 70 % of it). And pgonce's own publisher publishing the same
  batches with no database: the relay's limit, so the gap to it is what the claim, the mark and
  the commit per batch cost;
- enqueue: the same business insert alone, and the floor: the business insert plus one plain
  INSERT into a table shaped like the outbox with its primary key only (what "just insert into an
  outbox table" costs), one transaction each, on the same connections; the same for a batch of
  events in one statement (enqueue_many against one multi-row INSERT); and the polled floor, the
  floor's INSERT with the two pending indexes a relay that polls PostgreSQL reads, the limit of
  the floor targets; and the ordered polled floor, that INSERT after the aggregate's lock row,
  the limit of an enqueue that keeps commit order. The issue's targets follow in a table of their
  own, each row saying whether it was met, and their limits in another.

A broker that does not answer is reported as such and its rows are left out; the benchmark never
starts or stops the machine's brokers.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

import aio_pika
import nats
import psycopg
import uvloop
from nats.js.api import StorageType, StreamConfig
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from bench.clients import Measurement, Transaction
from bench.context import BenchContext
from bench.database_cost import postmaster, server_cpu
from bench.report import Table, Targets, percentile, ratio
from pgonce.core.outbox import OutboxEvent, OutboxMessage
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
#: Rounds of the relay table: the raw loop, the publisher alone and the relay in turn. Five: with
#: three, the RabbitMQ relay's best run over the raw loop's moved between 66 and 99 % over eleven
#: reports (94 and 80 % for the same code), one slow minute of the broker deciding the row.
RELAY_ROUNDS = 5
#: Events per transaction in the batch rows (enqueue_many).
BATCH_EVENTS = 10
BATCH_RANGE = range(BATCH_EVENTS)
PAYLOAD = {"order_id": 0, "amount": 4200, "currency": "EUR", "lines": [{"sku": "A-1", "qty": 2}]}

PublishBatch = Callable[[list[OutboxMessage]], Awaitable[None]]

SETUP = """
CREATE SCHEMA IF NOT EXISTS bench;
CREATE TABLE IF NOT EXISTS bench.outbox_orders (id bigserial PRIMARY KEY, ref text, amount int);
-- The floor: the outbox's columns, its primary key only, no checks, no lock row.
CREATE TABLE IF NOT EXISTS bench.outbox_floor (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregatetype text NOT NULL,
    aggregateid text NOT NULL,
    type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    attempts integer NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    last_error text,
    parked_at timestamptz
);
-- The polled floor: the floor with the two lookups a relay that polls PostgreSQL makes (pending
-- rows in id order; an aggregate's oldest pending row), as the outbox's partial indexes.
CREATE TABLE IF NOT EXISTS bench.outbox_polled (LIKE bench.outbox_floor INCLUDING ALL);
CREATE INDEX IF NOT EXISTS outbox_polled_pending ON bench.outbox_polled (id)
    WHERE published_at IS NULL AND parked_at IS NULL;
CREATE INDEX IF NOT EXISTS outbox_polled_pending_aggregate
    ON bench.outbox_polled (aggregatetype, aggregateid, id)
    WHERE published_at IS NULL AND parked_at IS NULL;
-- The ordered polled floor's lock rows: the aggregate's key and a counter, nothing else (pgonce's
-- outbox_aggregates is unlogged too).
CREATE UNLOGGED TABLE IF NOT EXISTS bench.outbox_locks (
    aggregatetype text NOT NULL,
    aggregateid text NOT NULL,
    events bigint NOT NULL,
    PRIMARY KEY (aggregatetype, aggregateid)
);
TRUNCATE bench.outbox_orders, bench.outbox_floor, bench.outbox_polled, bench.outbox_locks;
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
        for start in range(0, events, 1000):
            await store.enqueue_many(
                conn,
                [
                    OutboxEvent("order", str(n // EVENTS_PER_AGGREGATE), "order.created", PAYLOAD)
                    for n in range(start, min(start + 1000, events))
                ],
            )
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


def _relay_table(ctx: BenchContext) -> tuple[Table, dict[str, float]]:
    # Enough events for a run of a second or more on the slower broker: at 4,000 events a
    # RabbitMQ run took 0.4 s, and its ratio moved from 86 to 66 % between two runs.
    events = ctx.pick(20_000, short=12_000, quick=2_000)
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
            "`publish_async` PubAcks), with no database. The raw loop, the publisher alone and "
            f"the relay take turns, {RELAY_ROUNDS} rounds, every other round in the opposite "
            "order; each one's best run is reported.",
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

        # Alternated, every other round in the opposite order, each at its best: one run of
        # a few seconds moves by a fifth on a shared machine, for the relay and the raw loop
        # alike.
        relays: list[float] = []
        raws: list[float] = []
        alones: list[float] = []
        for number in range(RELAY_ROUNDS):
            order = [(raws, raw_run), (alones, alone_run), (relays, relay_run)]
            for runs, measure_run in order if number % 2 == 0 else order[::-1]:
                runs.append(await broker.fresh(measure_run))
        return max(relays), max(raws), max(alones)

    figures: dict[str, float] = {}
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
        figures[broker.name.split(" (")[0]] = relay_rate / raw_rate if raw_rate else 0.0
    _reset(ctx.dsn)
    return table, figures


async def _insert_alone(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO bench.outbox_orders (ref, amount) VALUES (%s, 4200)", (f"{client}-{seq}",)
        )


_STORE = AsyncOutboxStore()
_FLOOR_INSERT = (
    "INSERT INTO bench.outbox_floor (aggregatetype, aggregateid, type, payload)"
    " VALUES (%s, %s, %s, %s)"
)
_POLLED_INSERT = _FLOOR_INSERT.replace("outbox_floor", "outbox_polled")
# The polled floor's INSERT after the aggregate's lock row, in one statement as enqueue() does:
# the row lock that makes a second transaction of the aggregate wait for the first before it
# allocates an id, so that the ids of one aggregate follow the order of commit.
_ORDERED_INSERT = """
WITH locked AS (
    INSERT INTO bench.outbox_locks AS l (aggregatetype, aggregateid, events)
    VALUES (%(type)s, %(id)s, 1)
    ON CONFLICT (aggregatetype, aggregateid) DO UPDATE SET events = l.events + 1
    RETURNING 1
)
INSERT INTO bench.outbox_polled (aggregatetype, aggregateid, type, payload)
SELECT %(type)s, %(id)s, %(event)s, %(payload)s FROM locked
"""
_FLOOR_MANY = (
    "INSERT INTO bench.outbox_floor (aggregatetype, aggregateid, type, payload) VALUES "
    + ", ".join(["(%s, %s, %s, %s)"] * BATCH_EVENTS)
)
_POLLED_MANY = _FLOOR_MANY.replace("bench.outbox_floor", "bench.outbox_polled")


def _enqueue(ordered: bool) -> Transaction:
    async def transaction(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
        async with conn.transaction():
            ref = f"{client}-{seq}"
            await conn.execute(
                "INSERT INTO bench.outbox_orders (ref, amount) VALUES (%s, 4200)", (ref,)
            )
            await _STORE.enqueue(conn, "order", ref, "order.created", PAYLOAD, ordered=ordered)

    return transaction


async def _insert_and_floor(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
    """The floor: the business insert and one plain INSERT into a table shaped like the outbox
    with its primary key only (Debezium's outbox pattern): what any outbox costs at least."""
    async with conn.transaction():
        ref = f"{client}-{seq}"
        await conn.execute(
            "INSERT INTO bench.outbox_orders (ref, amount) VALUES (%s, 4200)", (ref,)
        )
        await conn.execute(_FLOOR_INSERT, ("order", ref, "order.created", Jsonb(PAYLOAD)))


async def _insert_and_polled(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
    """The polled floor: the floor's INSERT into a table with the relay's two pending indexes,
    the least an outbox writes whose relay finds its rows in PostgreSQL rather than in the WAL."""
    async with conn.transaction():
        ref = f"{client}-{seq}"
        await conn.execute(
            "INSERT INTO bench.outbox_orders (ref, amount) VALUES (%s, 4200)", (ref,)
        )
        await conn.execute(_POLLED_INSERT, ("order", ref, "order.created", Jsonb(PAYLOAD)))


async def _insert_and_ordered(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
    """The ordered polled floor: the polled floor's INSERT after its aggregate's lock row, one
    statement, plain tables: the least a polled outbox writes that keeps commit order."""
    async with conn.transaction():
        ref = f"{client}-{seq}"
        await conn.execute(
            "INSERT INTO bench.outbox_orders (ref, amount) VALUES (%s, 4200)", (ref,)
        )
        await conn.execute(
            _ORDERED_INSERT,
            {"type": "order", "id": ref, "event": "order.created", "payload": Jsonb(PAYLOAD)},
        )


async def _insert_and_enqueue_many(
    conn: psycopg.AsyncConnection[Any], client: int, seq: int
) -> None:
    async with conn.transaction():
        ref = f"{client}-{seq}"
        await conn.execute(
            "INSERT INTO bench.outbox_orders (ref, amount) VALUES (%s, 4200)", (ref,)
        )
        await _STORE.enqueue_many(
            conn, [OutboxEvent("order", ref, f"order.line.{n}", PAYLOAD) for n in BATCH_RANGE]
        )


def _insert_and_many(statement: str) -> Transaction:
    """The business insert and one plain multi-row INSERT of the batch's events."""

    async def transaction(conn: psycopg.AsyncConnection[Any], client: int, seq: int) -> None:
        async with conn.transaction():
            ref = f"{client}-{seq}"
            await conn.execute(
                "INSERT INTO bench.outbox_orders (ref, amount) VALUES (%s, 4200)", (ref,)
            )
            params: list[Any] = []
            for n in BATCH_RANGE:
                params += ["order", ref, f"order.line.{n}", Jsonb(PAYLOAD)]
            await conn.execute(statement, params)

    return transaction


class _Figures(NamedTuple):
    run: Measurement
    wal_per_tx: float
    server_cpu_us: float


#: The enqueue table's turns: each variant runs this long on every client, then the next one, so
#: that what else the machine does (a checkpoint, autovacuum on the tables, a slow flush of the
#: shared disk, which decides a lone client's commit) lands on every variant of a round alike.
#: With one contiguous run per variant and round, the runs of a pair were seconds apart, and one
#: round put insert + enqueue at 128 % of insert alone, the next at 55 %.
TURN = 0.25


@dataclass
class _Tally:
    """One variant's turns of one round, added up."""

    tx: int = 0
    seconds: float = 0.0
    client_cpu: float = 0.0
    wal: int = 0
    server_cpu: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def figures(self) -> _Figures:
        tx = max(self.tx, 1)
        run = Measurement(
            tx=self.tx,
            seconds=self.seconds,
            p50_ms=percentile(self.latencies, 50),
            p99_ms=percentile(self.latencies, 99),
            cpu_us_per_tx=self.client_cpu / tx * 1e6,
        )
        return _Figures(run, self.wal / tx, self.server_cpu / tx * 1e6)


def interleaved(
    dsn: str, clients: int, rounds: int, each: float, transactions: list[Transaction]
) -> list[dict[int, _Figures]]:
    """Every round's figures by variant index: each variant runs ``each`` seconds a round, in
    turns of :data:`TURN` interleaved across the variants (the order reversed every other
    turn), on the same ``clients`` connections, open throughout. A sequence number runs through
    the whole measurement: every transaction has an aggregate of its own."""
    return uvloop.run(_interleaved(dsn, clients, rounds, each, transactions))


async def _interleaved(
    dsn: str, clients: int, rounds: int, each: float, transactions: list[Transaction]
) -> list[dict[int, _Figures]]:
    pm = postmaster(dsn)  # the bench's own server runs here
    assert pm is not None
    turns = max(1, round(each / TURN))
    sequence = 0

    def next_seq() -> int:
        nonlocal sequence
        sequence += 1
        return sequence

    async def turn(
        conns: list[psycopg.AsyncConnection[Any]], run: Transaction, tally: _Tally
    ) -> None:
        stop = asyncio.Event()

        async def client(number: int, conn: psycopg.AsyncConnection[Any]) -> None:
            while not stop.is_set():
                started = time.perf_counter()
                await run(conn, number, next_seq())
                tally.latencies.append((time.perf_counter() - started) * 1000)

        done = len(tally.latencies)
        cpu, started = time.process_time(), time.perf_counter()
        tasks = [asyncio.create_task(client(n, c)) for n, c in enumerate(conns)]
        await asyncio.sleep(each / turns)
        stop.set()
        await asyncio.gather(*tasks)
        tally.seconds += time.perf_counter() - started
        tally.client_cpu += time.process_time() - cpu
        tally.tx += len(tally.latencies) - done

    async with (
        AsyncConnectionPool(dsn, min_size=clients, max_size=clients, open=False) as pool,
        await psycopg.AsyncConnection.connect(dsn, autocommit=True) as probe,
    ):
        await pool.wait()
        conns = [await pool.getconn() for _ in range(clients)]

        async def wal() -> int:
            cursor = await probe.execute(
                "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')"
            )
            row = await cursor.fetchone()
            assert row is not None
            return int(row[0])

        # Warm up: every variant's statements prepared on every connection before any clock.
        for run in transactions:
            for number, conn in enumerate(conns):
                for _ in range(6):
                    await run(conn, number, next_seq())
        runs: list[dict[int, _Figures]] = []
        order = list(range(len(transactions)))
        for number in range(rounds):
            tallies = [_Tally() for _ in transactions]
            for step in range(turns):
                for i in order if (number * turns + step) % 2 == 0 else order[::-1]:
                    wal_before, server_before = await wal(), server_cpu(pm)
                    await turn(conns, transactions[i], tallies[i])
                    tallies[i].wal += await wal() - wal_before
                    tallies[i].server_cpu += server_cpu(pm) - server_before
            runs.append({i: tally.figures() for i, tally in enumerate(tallies)})
        for conn in conns:
            await pool.putconn(conn)
    return runs


FLOOR = "insert + plain outbox INSERT (the floor)"
POLLED = "insert + plain INSERT with the relay's pending indexes (the polled floor)"
ORDERED = "insert + the polled floor's INSERT after a lock row (the ordered polled floor)"
BATCH_FLOOR = f"insert + plain {BATCH_EVENTS}-row INSERT (the batch's floor)"
BATCH_POLLED = (
    f"insert + plain {BATCH_EVENTS}-row INSERT with the relay's pending indexes "
    "(the batch's polled floor)"
)
#: The variants of the enqueue table, in the order they run in each round.
VARIANTS = (
    ("insert alone", _insert_alone),
    (FLOOR, _insert_and_floor),
    (POLLED, _insert_and_polled),
    (ORDERED, _insert_and_ordered),
    ("insert + enqueue", _enqueue(ordered=True)),
    ("insert + enqueue(ordered=False)", _enqueue(ordered=False)),
    (BATCH_FLOOR, _insert_and_many(_FLOOR_MANY)),
    (BATCH_POLLED, _insert_and_many(_POLLED_MANY)),
    (f"insert + enqueue_many({BATCH_EVENTS} events)", _insert_and_enqueue_many),
)
#: Each outbox write's floor, for the "vs its floor" column.
FLOORS = {
    POLLED: FLOOR,
    ORDERED: FLOOR,
    "insert + enqueue": FLOOR,
    "insert + enqueue(ordered=False)": FLOOR,
    BATCH_POLLED: BATCH_FLOOR,
    VARIANTS[-1][0]: BATCH_FLOOR,
}


def _enqueue_table(ctx: BenchContext) -> tuple[Table, dict[int, dict[str, float]]]:
    # Many short rounds rather than a few long ones: the median of the rounds' ratios is what a
    # shared machine moves least.
    each = ctx.seconds(2)
    rounds = ctx.pick(7, short=5, quick=1)
    table = Table(
        "Outbox enqueue overhead on the business transaction",
        [
            "clients",
            "variant",
            "tx/s",
            "vs insert alone",
            "vs its floor",
            "p99",
            "WAL bytes/tx",
            "PostgreSQL CPU µs/tx",
        ],
        notes=[
            "Each transaction: BEGIN; INSERT the business row; [the outbox write]; COMMIT. "
            f"{rounds} rounds of {each:.1f} s of every variant, each one's best round "
            f"reported; within a round the variants take turns of {TURN:g} s on the same "
            "connections (the order reversed every other turn), so that what else the machine "
            "does lands on all of them alike. Every transaction has its own aggregate (one "
            "order each, never used before), so no enqueue waits for another.",
            "The floor: one plain INSERT into a table shaped like the outbox (the same columns) "
            "with its primary key only, as Debezium's outbox pattern writes it; enqueue adds the "
            "aggregate's lock row (unlogged, for the order of commit), the outbox's pending "
            "indexes and column checks, and the NOTIFY check, in one statement. ordered=False "
            f"leaves out the lock row. The batch rows write {BATCH_EVENTS} events of one "
            "aggregate per transaction in one statement; their floor is one plain "
            f"{BATCH_EVENTS}-row INSERT, and their polled floor the same INSERT into the "
            "polled floor's table (below).",
            "The polled floor: the floor's INSERT into a table that also has the outbox's two "
            "pending indexes, the lookups of a relay that finds its rows in PostgreSQL (pending "
            "rows in id order; an aggregate's oldest pending row) rather than in the WAL, as "
            "Debezium's change data capture does: the least such an outbox writes, with no lock "
            "row, column checks or NOTIFY check.",
            "The ordered polled floor: the same INSERT after the aggregate's lock row (a plain "
            "unlogged table of the aggregate's key and a counter, upserted), in one statement "
            "as enqueue() writes them: the least a polled outbox writes that keeps an "
            "aggregate's events in the order of commit, with no column checks, NOTIFY check or "
            "index by age on the lock rows.",
            "WAL bytes/tx: pg_current_wal_insert_lsn() before and after each of the "
            "variant's turns; PostgreSQL CPU: all its processes' CPU over each turn (from "
            "/proc); both summed over the round's turns, per measured transaction.",
        ],
    )
    _reset(ctx.dsn)
    figures: dict[int, dict[str, float]] = {}
    for clients in (1, 8):
        runs = interleaved(ctx.dsn, clients, rounds, each, [t for _, t in VARIANTS])
        best = [max((r[i] for r in runs), key=lambda f: f.run.tps) for i in range(len(VARIANTS))]
        by_name = {name: f for (name, _), f in zip(VARIANTS, best, strict=True)}
        alone = by_name["insert alone"].run.tps
        for name, f in by_name.items():
            floor = FLOORS.get(name)
            table.add(
                clients,
                name,
                f"{f.run.tps:,.0f}",
                ratio(f.run.tps, alone, "insert alone"),
                ratio(f.run.tps, by_name[floor].run.tps, "floor") if floor else "",
                f"{f.run.p99_ms:.2f} ms",
                f"{f.wal_per_tx:,.0f}",
                f"{f.server_cpu_us:,.0f}",
            )
        # Each pair's best rounds, and its median round (each round runs every variant back to
        # back): the figure least moved by what else the machine did meanwhile.
        figures[clients] = {}
        for key, name, reference in _PAIRS:
            figures[clients][key] = by_name[name].run.tps / by_name[reference].run.tps
            rounds_ratios = _rounds(runs, name, reference)
            figures[clients][f"{key}, median round"] = statistics.median(rounds_ratios or [0.0])
        against_alone = _rounds(runs, "insert + enqueue", "insert alone")
        against_floor = _rounds(runs, "insert + enqueue", FLOOR)
        against_polled = _rounds(runs, "insert + enqueue", POLLED)
        against_ordered = _rounds(runs, "insert + enqueue", ORDERED)
        table.notes.append(
            f"{clients} client(s), insert + enqueue round by round: "
            + ", ".join(f"{100 * r:.0f}" for r in against_alone)
            + " % of insert alone; "
            + ", ".join(f"{100 * r:.0f}" for r in against_floor)
            + " % of the floor; "
            + ", ".join(f"{100 * r:.0f}" for r in against_polled)
            + " % of the polled floor; "
            + ", ".join(f"{100 * r:.0f}" for r in against_ordered)
            + " % of the ordered polled floor."
        )
    _reset(ctx.dsn)
    return table, figures


#: The figures the targets and limits read: (key, variant, the variant it is measured against).
_PAIRS = (
    ("vs alone", "insert + enqueue", "insert alone"),
    ("vs floor", "insert + enqueue", FLOOR),
    ("floor vs alone", FLOOR, "insert alone"),
    ("polled vs floor", POLLED, FLOOR),
    ("vs polled", "insert + enqueue", POLLED),
    ("ordered vs floor", ORDERED, FLOOR),
    ("vs ordered", "insert + enqueue", ORDERED),
)


def _rounds(runs: list[dict[int, _Figures]], name: str, reference: str) -> list[float]:
    """``name``'s throughput over ``reference``'s, round by round."""
    i, j = (next(n for n, (v, _) in enumerate(VARIANTS) if v == x) for x in (name, reference))
    return [r[i].run.tps / r[j].run.tps for r in runs if r[j].run.tps]


def _targets(relay: dict[str, float], enqueue: dict[int, dict[str, float]]) -> Table:
    targets = Targets(
        "Outbox: the issue's targets",
        "From the two tables above, in this run. The relay's reference is the raw confirmed "
        "publish loop of the same client library. Each statement is a round trip of its own: "
        "insert alone is three (BEGIN, INSERT, COMMIT), any transaction that also writes an "
        "outbox row four; where the floor's row misses 80 % of insert alone, that target is "
        "beyond what one plain INSERT reaches in this shape, and the floor is the goal.",
    )
    for clients, figures in enqueue.items():
        for which in ("best rounds", "median round"):
            key = "vs alone" if which == "best rounds" else "vs alone, median round"
            targets.at_least(
                f"insert + enqueue vs insert alone, {clients} client(s), {which}",
                figures[key],
                0.80,
            )
    for clients, figures in enqueue.items():
        # Whether the 80 % above is within reach of any outbox: the floor, one plain INSERT,
        # adds a round trip of its own to a transaction of three, as every outbox write does.
        targets.at_least(
            f"insert + plain outbox INSERT (the floor) vs insert alone, {clients} client(s), "
            "best rounds: the most any outbox reaches in this shape",
            figures["floor vs alone"],
            0.80,
        )
    for clients, figures in enqueue.items():
        for which in ("best rounds", "median round"):
            key = "vs floor" if which == "best rounds" else "vs floor, median round"
            targets.at_least(
                f"insert + enqueue vs insert + plain outbox INSERT (the floor), {clients} "
                f"client(s), {which}",
                figures[key],
                0.95,
            )
    for broker, value in relay.items():
        targets.at_least(f"relay vs raw confirmed publish, {broker}", value, 0.85)
    return targets.table


def _limits(enqueue: dict[int, dict[str, float]]) -> Table:
    """How far the floor targets can go, each limit measured in this run."""
    table = Table(
        "Outbox: the limits of the targets",
        ["figure", "target", "limit, measured", "insert + enqueue vs its limit", "what sets it"],
        notes=[
            "A limit is what the figure would be with pgonce's own work taken out, measured "
            "beside it: a target beyond its limit cannot be met by any change to enqueue's "
            "statement, only by changing what is measured against what. Best rounds / median "
            "round, from the enqueue table above.",
        ],
    )

    def pair(figures: dict[str, float], key: str) -> str:
        return f"{100 * figures[key]:.0f} / {100 * figures[key + ', median round']:.0f} %"

    for clients, figures in enqueue.items():
        table.add(
            f"insert + enqueue vs the floor, {clients} client(s)",
            "≥ 95 %",
            pair(figures, "polled vs floor"),
            pair(figures, "vs polled"),
            "the polled floor: the same plain INSERT into a table with the two pending indexes a "
            "relay reads in PostgreSQL (Debezium's floor has none: its relay reads the WAL); "
            "enqueue adds to it the lock row that keeps an aggregate's events in commit order, "
            "the column checks and the NOTIFY check",
        )
        table.add(
            f"insert + enqueue vs the floor, keeping commit order, {clients} client(s)",
            "≥ 95 %",
            pair(figures, "ordered vs floor"),
            pair(figures, "vs ordered"),
            "the ordered polled floor: the polled floor's INSERT after the aggregate's lock row, "
            "in one statement; enqueue(ordered=False) goes without the lock row, and the floor "
            "of that is the row above. Between the ordered floor and enqueue: the column checks, "
            "the NOTIFY check and the lock rows' index by age for the sweeper",
        )
    return table


def run(ctx: BenchContext) -> list[Table]:
    relay_table, relay = _relay_table(ctx)
    enqueue_table, enqueue = _enqueue_table(ctx)
    return [relay_table, enqueue_table, _targets(relay, enqueue), _limits(enqueue)]
