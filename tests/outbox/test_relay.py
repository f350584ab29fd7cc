"""The relay on real PostgreSQL and real brokers: publish-then-mark, backoff, parking, replay,
outages, per-aggregate locking and the LISTEN wake-up."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce.core.outbox import OutboxMessage, RetryPolicy
from pgonce.publishers.base import PublishResult
from pgonce.publishers.http import HttpPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import Relay
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store._sync.outbox import OutboxStore, enqueue
from tests.outbox.brokers import Received, redis_delete, redis_read
from tests.outbox.conftest import Receiver, free_port, fresh, wait_until

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def fill(dsn: str, count: int, aggregates: int, aggregatetype: str = "order") -> list[int]:
    """Enqueue ``count`` events round-robin over ``aggregates`` aggregates; payload = sequence
    number within the aggregate."""
    ids = []
    with psycopg.connect(dsn) as conn:
        for n in range(count):
            ids.append(
                enqueue(conn, aggregatetype, str(n % aggregates), "e", {"seq": n // aggregates})
            )
        conn.commit()
    return ids


def assert_in_order_per_aggregate(received: list[Received]) -> None:
    seqs: dict[str, list[int]] = defaultdict(list)
    for r in received:
        seqs[r.aggregateid].append(r.payload["seq"])
    for aggregate, got in seqs.items():
        assert got == sorted(got), f"aggregate {aggregate} out of order: {got[:20]}"


def pending_rows(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT id, attempts, next_attempt_at, parked_at, last_error FROM pgonce.outbox"
            " WHERE published_at IS NULL ORDER BY id"
        ).fetchall()


async def test_relay_publishes_every_row_once_in_order_and_marks_it(
    dsn: str, redis_url: str
) -> None:
    key = fresh("pgonce-test-")
    ids = fill(dsn, 120, aggregates=7)
    relay = Relay(dsn, RedisStreamsPublisher(redis_url, routing=lambda m: key), batch_size=50)
    try:
        stats = await relay.drain()
        received = await redis_read(redis_url, key)
    finally:
        await relay.publisher.close()
        await redis_delete(redis_url, key)
    assert stats.published == 120
    assert sorted(int(r.message_id) for r in received) == ids
    assert_in_order_per_aggregate(received)
    assert pending_rows(dsn) == []


async def test_refused_rows_back_off_then_park_and_replay(dsn: str, receiver: Receiver) -> None:
    receiver.status = lambda _n: 500
    [row_id] = fill(dsn, 1, aggregates=1)
    # The relay's clock, set by the test: a little after the row was enqueued.
    T0 = datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=1)
    policy = RetryPolicy(max_attempts=3, base=timedelta(seconds=10), jitter=0.0)
    relay = Relay(dsn, HttpPublisher(url=receiver.url, secret=SECRET), policy=policy)
    store = AsyncOutboxStore()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        first = await relay.run_once(conn, now=T0)
        assert (first.claimed, first.refused, first.published) == (1, 1, 0)
        [(_, attempts, next_at, parked, error)] = pending_rows(dsn)
        assert (attempts, next_at, parked) == (1, T0 + timedelta(seconds=10), None)
        assert "500" in error
        # Not due yet: the backoff holds the row back.
        assert (await relay.run_once(conn, now=T0 + timedelta(seconds=9))).claimed == 0
        second = await relay.run_once(conn, now=T0 + timedelta(seconds=10))
        assert second.refused == 1
        third = await relay.run_once(conn, now=T0 + timedelta(seconds=30))
        assert third.parked == 1
        # Parked: no relay takes it any more, however late it is.
        assert (await relay.run_once(conn, now=T0 + timedelta(days=9))).claimed == 0
        assert (await store.counts(conn)).parked == 1
        receiver.status = lambda _n: 204
        async with conn.transaction():
            assert await store.replay(conn, ids=[row_id]) == [row_id]
        replayed = await relay.run_once(conn)
        assert replayed.published == 1
    await relay.publisher.close()
    assert [h["webhook-id"] for h, _ in receiver.requests] == [str(row_id)] * 4
    assert pending_rows(dsn) == []


async def test_a_broker_that_is_down_makes_rows_wait_without_counting_attempts(dsn: str) -> None:
    fill(dsn, 3, aggregates=1)
    nobody = RabbitMQPublisher(f"amqp://guest:guest@127.0.0.1:{free_port()}/")
    relay = Relay(dsn, nobody, policy=RetryPolicy(max_attempts=1))
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for _ in range(3):
            report = await relay.run_once(conn)
            assert report.broker_down
            assert report.unsettled == 3
    assert [(attempts, parked) for _, attempts, _, parked, _ in pending_rows(dsn)] == [
        (0, None)
    ] * 3


class _HeldBroker:
    """Acknowledges every batch; the first one only once ``release`` is set. Counts the batches
    at the broker at once."""

    name = "held"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.at_once = self.most_at_once = self.batches = 0

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        self.at_once += 1
        self.most_at_once = max(self.most_at_once, self.at_once)
        self.batches += 1
        try:
            if self.batches == 1:
                await self.release.wait()
            return PublishResult(acked=frozenset(m.id for m in batch))
        finally:
            self.at_once -= 1

    async def close(self) -> None:
        pass


async def test_the_next_batch_is_claimed_while_one_is_at_the_broker(dsn: str) -> None:
    # Ten aggregates of one row, batches of five, one batch in flight: while the first batch waits
    # for its acknowledgements, a second loop holds the next five rows, ready to publish.
    fill(dsn, 10, aggregates=10)
    broker = _HeldBroker()
    relay = Relay(dsn, broker, batch_size=5, concurrency=1, listen=False)
    draining = asyncio.create_task(relay.drain())

    async def claims_held() -> int:
        # Watched without a row lock: a probe that locked the free rows, even for an instant,
        # would make a loop claiming at that instant find nothing and end.
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state = 'idle in transaction' AND backend_xid IS NOT NULL"
            )
            row = await cur.fetchone()
            assert row is not None
            return int(row[0])

    async def both_loops_hold_a_claim() -> bool:
        return await claims_held() == 2

    async def nothing_left_to_claim() -> bool:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            cur = await conn.execute(
                "SELECT id FROM pgonce.outbox WHERE published_at IS NULL FOR UPDATE SKIP LOCKED"
            )
            return not await cur.fetchall()

    try:
        await wait_until(lambda: broker.batches == 1)
        # Both loops hold a claim (a transaction with row locks), one of them at the broker.
        await wait_until(both_loops_hold_a_claim)
        # All ten rows are held, and the probe now locks none: claimed, and held back from the
        # broker: one batch in flight means one.
        assert await nothing_left_to_claim()
        assert broker.batches == 1
    finally:
        broker.release.set()
        stats = await draining
    assert (stats.published, broker.batches, broker.most_at_once) == (10, 2, 1)
    assert pending_rows(dsn) == []


@pytest.mark.pooled
async def test_two_relays_never_hold_rows_of_one_aggregate_at_once(dsn: str) -> None:
    # Aggregates "0" and "1", three rows each, interleaved.
    fill(dsn, 6, aggregates=2)
    store = AsyncOutboxStore()
    first, second, third = [await psycopg.AsyncConnection.connect(dsn) for _ in range(3)]
    try:
        # A batch takes aggregates in the order of their heads, each with its prefix: limit 3 is
        # filled by aggregate "0" (rows 1, 3, 5), and "1" stays free.
        held = await store.claim(first, limit=3)
        assert [m.aggregateid for m in held] == ["0", "0", "0"]
        assert [m.id for m in held] == sorted(m.id for m in held)
        # The second relay gets only what the first does not hold; the third finds nothing.
        taken = await store.claim(second, limit=10)
        assert [m.aggregateid for m in taken] == ["1", "1", "1"]
        assert await store.claim(third, limit=10) == []
        await first.rollback()
        # Released: the third relay now gets aggregate "0", in id order.
        again = await store.claim(third, limit=10)
        assert [m.id for m in again] == [m.id for m in held]
    finally:
        for conn in (first, second, third):
            await conn.close()


def test_a_claim_reads_only_what_its_batch_needs_however_long_the_backlog(dsn: str) -> None:
    # 20,000 pending rows, four per aggregate, vacuumed as autovacuum would. A claim of 200 rows
    # takes 50 aggregates; the plan must walk the pending index from the oldest row and stop
    # there (about 650 buffers). Reading the whole backlog, what the claim once did (a subplan
    # for every pending row, then a sort), touches over 40,000: every batch got slower with the
    # backlog.
    with psycopg.connect(dsn, autocommit=True) as conn:
        with (
            conn.cursor() as cur,
            cur.copy(
                "COPY pgonce.outbox (aggregatetype, aggregateid, type, payload) FROM STDIN"
            ) as copy,
        ):
            for n in range(20000):
                copy.write_row(("order", str(n // 4), "e", "{}"))
        conn.execute("VACUUM ANALYZE pgonce.outbox")
    query = OutboxStore()._sql.claim
    with psycopg.connect(dsn) as conn:
        explained = conn.execute(
            b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query,
            {"limit": 200, "per_aggregate": 50, "now": None},
        ).fetchone()
        conn.rollback()
    assert explained is not None
    top = explained[0][0]["Plan"]
    assert top["Actual Rows"] == 200
    buffers = top["Shared Hit Blocks"] + top["Shared Read Blocks"]
    assert buffers < 2000, f"the claim of 200 rows touched {buffers} buffers"


async def test_a_busy_aggregate_does_not_hold_up_the_others(dsn: str) -> None:
    fill(dsn, 4, aggregates=1, aggregatetype="hot")
    fill(dsn, 2, aggregates=2, aggregatetype="cold")
    store = AsyncOutboxStore()
    first = await psycopg.AsyncConnection.connect(dsn)
    second = await psycopg.AsyncConnection.connect(dsn)
    try:
        held = await store.claim(first, limit=1)
        assert [m.aggregatetype for m in held] == ["hot"]
        others = await store.claim(second, limit=10)
        assert sorted(m.aggregatetype for m in others) == ["cold", "cold"]
    finally:
        await first.close()
        await second.close()


async def test_a_notification_wakes_a_waiting_relay_long_before_the_poll(
    dsn: str, redis_url: str
) -> None:
    key = fresh("pgonce-test-")
    relay = Relay(
        dsn,
        RedisStreamsPublisher(redis_url, routing=lambda m: key),
        poll_interval=timedelta(seconds=30),
    )
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        # Wait until the relay is idle (its first, empty, batch done) and listening.
        await wait_until(lambda: relay.stats.batches >= 1)
        await asyncio.to_thread(fill, dsn, 3, 1)

        async def arrived() -> bool:
            return len(await redis_read(redis_url, key)) == 3

        await wait_until(arrived, within=10)
    finally:
        stop.set()
        await running
        await redis_delete(redis_url, key)


def test_replay_by_aggregate_type_leaves_other_parked_rows(conn: psycopg.Connection[Any]) -> None:
    store = OutboxStore()
    enqueue(conn, "order", "1", "e", {})
    enqueue(conn, "invoice", "1", "e", {})
    conn.execute("UPDATE pgonce.outbox SET parked_at = now()")
    assert len(store.replay(conn, aggregatetype="order")) == 1
    assert store.counts(conn).parked == 1


@pytest.mark.parametrize("limit", [0, -1])
async def test_a_batch_of_nothing_is_a_usage_error(aconn: Any, limit: int) -> None:
    from pgonce.errors import UsageError

    with pytest.raises(UsageError):
        await AsyncOutboxStore().claim(aconn, limit=limit)


async def test_a_row_in_backoff_holds_back_the_rest_of_its_aggregate(
    dsn: str, receiver: Receiver
) -> None:
    # Aggregate "0": rows 1, 3, 5; aggregate "1": rows 2, 4, 6. The first delivery fails.
    ids = fill(dsn, 6, aggregates=2)
    failures = {str(ids[0]): 1}

    def status(_count: int) -> int:
        webhook_id = receiver.requests[-1][0]["webhook-id"]
        if failures.get(webhook_id):
            failures[webhook_id] -= 1
            return 500
        return 204

    receiver.status = status
    relay = Relay(dsn, HttpPublisher(url=receiver.url, secret=SECRET), batch_size=10)
    later = datetime.now(UTC) + timedelta(minutes=1)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        first = await relay.run_once(conn, now=later)
        # Aggregate "0" stopped at its refused head; aggregate "1" went through.
        assert (first.refused, first.published) == (1, 3)
        # Its head waits for the backoff, and so do the rows behind it.
        assert (await relay.run_once(conn, now=later)).claimed == 0
        after = await relay.run_once(conn, now=later + timedelta(hours=1))
        assert after.published == 3
    await relay.publisher.close()
    delivered = [h["webhook-id"] for h, _ in receiver.requests]
    zero = [str(i) for i in ids[0::2]]
    assert [d for d in delivered if d in zero] == [zero[0], *zero]
