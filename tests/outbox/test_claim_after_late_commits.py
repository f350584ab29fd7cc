"""The write side against the relay's claim: rows that become pending behind a held head.

Holding an aggregate's head keeps other relays off its later rows only while no row with a smaller
id can become pending while another relay holds a later head. Ordered producers never do that (the
lock row), and a replay waits for both; an unordered producer's late commit does, so the claim
locks every row it hands out and ends an aggregate's prefix before a row another relay holds.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from pgonce.errors import DatabaseError
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store._async.outbox import enqueue as aenqueue
from pgonce.store._sync.outbox import OutboxStore, enqueue
from tests.outbox.conftest import wait_until


def claimed(conn: psycopg.Connection[Any]) -> list[int]:
    return [message.id for message in OutboxStore().claim(conn, limit=10)]


def test_a_late_unordered_commit_does_not_hand_rows_in_flight_to_a_second_relay(
    dsn: str,
) -> None:
    with (
        psycopg.connect(dsn) as early,
        psycopg.connect(dsn) as late,
        psycopg.connect(dsn) as relay1,
        psycopg.connect(dsn) as relay2,
    ):
        first = enqueue(early, "audit", "u1", "a", {}, ordered=False)
        second = enqueue(late, "audit", "u1", "b", {}, ordered=False)
        late.commit()
        assert claimed(relay1) == [second]  # in flight: relay1 has not marked it yet
        early.commit()
        in_flight = set(claimed(relay2)) & {second}
        relay1.rollback()
        relay2.rollback()
        assert first < second
        assert in_flight == set()


async def test_a_replay_waits_for_a_relay_publishing_later_rows_of_its_aggregate(
    dsn: str,
) -> None:
    """A replayed row becomes its aggregate's head: the replay commits only once no relay holds
    a later head, so no second relay takes rows in flight with it."""
    store = AsyncOutboxStore()
    conn = await psycopg.AsyncConnection.connect(dsn)
    relay1 = await psycopg.AsyncConnection.connect(dsn)
    relay2 = await psycopg.AsyncConnection.connect(dsn)
    watcher = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        parked = await aenqueue(conn, "order", "1", "a", {})
        later = await aenqueue(conn, "order", "1", "b", {})
        await conn.execute("UPDATE pgonce.outbox SET parked_at = now() WHERE id = %s", (parked,))
        await conn.commit()
        assert [m.id for m in await store.claim(relay1, limit=10)] == [later]
        replaying = asyncio.create_task(store.replay(conn, ids=[parked]))
        pid = conn.info.backend_pid

        async def replay_is_waiting_on_a_lock() -> bool:
            cur = await watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            )
            return await cur.fetchone() == ("Lock",)

        await wait_until(replay_is_waiting_on_a_lock)
        assert await store.claim(relay2, limit=10) == []
        await relay2.rollback()
        assert await store.mark_published(relay1, [later]) == 1
        await relay1.commit()
        assert await replaying == [parked]
        await conn.commit()
        assert [m.id for m in await store.claim(relay2, limit=10)] == [parked]
        await relay2.rollback()
    finally:
        for c in (conn, relay1, relay2, watcher):
            await c.close()


async def test_an_ordered_producer_waits_for_a_replay_of_its_aggregate(dsn: str) -> None:
    """Nor can an event committed during the replay become a head a relay takes meanwhile."""
    store = AsyncOutboxStore()
    conn = await psycopg.AsyncConnection.connect(dsn)
    producer = await psycopg.AsyncConnection.connect(dsn)
    watcher = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        parked = await aenqueue(conn, "order", "1", "a", {})
        await conn.execute("UPDATE pgonce.outbox SET parked_at = now() WHERE id = %s", (parked,))
        await conn.commit()
        assert await store.replay(conn, ids=[parked]) == [parked]
        enqueueing = asyncio.create_task(aenqueue(producer, "order", "1", "b", {}))
        pid = producer.info.backend_pid

        async def producer_is_waiting_on_a_lock() -> bool:
            cur = await watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            )
            return await cur.fetchone() == ("Lock",)

        await wait_until(producer_is_waiting_on_a_lock)
        await conn.commit()
        assert await enqueueing > parked
        await producer.commit()
    finally:
        for c in (conn, producer, watcher):
            await c.close()


def test_an_ordered_event_rolled_back_to_a_savepoint_keeps_the_aggregate_held(dsn: str) -> None:
    """The transaction's earlier event holds the lock row past a rolled back savepoint."""
    with (
        psycopg.connect(dsn) as first,
        psycopg.connect(dsn, autocommit=True) as second,
        psycopg.connect(dsn, autocommit=True) as watcher,
    ):
        held = enqueue(first, "order", "1", "a", {})
        with pytest.raises(RuntimeError), first.transaction():
            enqueue(first, "order", "1", "b", {})
            raise RuntimeError("rolled back to the savepoint")
        second.execute("SET lock_timeout = '200ms'")
        with pytest.raises(DatabaseError, match="lock timeout"), second.transaction():
            enqueue(second, "order", "1", "c", {})
        first.commit()
        with second.transaction():
            after = enqueue(second, "order", "1", "c", {})
        assert held < after
        rows = watcher.execute("SELECT type FROM pgonce.outbox ORDER BY id").fetchall()
        assert rows == [("a",), ("c",)]


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_snapshot_producer_behind_a_concurrent_one_fails_rather_than_misorders(
    dsn: str, isolation: str
) -> None:
    """Under snapshot isolation the second producer of an aggregate cannot take an id after a
    commit it does not see: the upsert of the lock row fails with a serialization failure."""
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        second.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        second.execute("SELECT 1")  # its snapshot, before the first producer commits
        enqueue(first, "order", "1", "a", {})
        first.commit()
        with pytest.raises(DatabaseError) as caught:
            enqueue(second, "order", "1", "b", {})
        assert isinstance(caught.value.__cause__, psycopg.errors.SerializationFailure)


async def test_producers_of_two_aggregates_in_opposite_orders_deadlock_and_write_nothing(
    dsn: str,
) -> None:
    first = await psycopg.AsyncConnection.connect(dsn)
    second = await psycopg.AsyncConnection.connect(dsn)
    watcher = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        await aenqueue(first, "order", "B", "a", {})
        await aenqueue(second, "order", "A", "a", {})
        blocked = asyncio.create_task(aenqueue(first, "order", "A", "b", {}))
        first_pid = first.info.backend_pid

        async def first_is_waiting_on_a_lock() -> bool:
            cur = await watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (first_pid,)
            )
            return await cur.fetchone() == ("Lock",)

        await wait_until(first_is_waiting_on_a_lock)
        # PostgreSQL ends one of the two, whichever checks first; the other goes on.
        results = await asyncio.gather(
            blocked, aenqueue(second, "order", "B", "b", {}), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(failed) == 1
        assert isinstance(failed[0], DatabaseError)
        assert isinstance(failed[0].__cause__, psycopg.errors.DeadlockDetected)
        survivor, victim = (second, first) if failed[0] is results[0] else (first, second)
        await victim.rollback()
        await survivor.commit()
        cur = await watcher.execute("SELECT aggregateid, type FROM pgonce.outbox ORDER BY id")
        rows = await cur.fetchall()
        assert sorted(rows) == [("A", "a"), ("B", "b")] or sorted(rows) == [("A", "b"), ("B", "a")]
    finally:
        for c in (first, second, watcher):
            await c.close()
