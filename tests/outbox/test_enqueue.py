"""enqueue() on real PostgreSQL: the event commits or rolls back with the business write."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pgonce.core.channels import notify_channel
from pgonce.errors import NotInTransaction, UsageError
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store._async.outbox import enqueue as aenqueue
from pgonce.store._sync.outbox import OutboxStore, enqueue
from tests.outbox.conftest import wait_until


def outbox_rows(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    with conn.transaction():
        return conn.execute(
            "SELECT aggregatetype, aggregateid, type, payload, headers"
            " FROM pgonce.outbox ORDER BY id"
        ).fetchall()


@pytest.mark.pooled
def test_event_commits_with_the_business_write(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES (1)")
            enqueue(conn, "order", "1", "order.created", {"total": 5}, headers={"tenant": "t1"})
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (1,)
        assert outbox_rows(conn) == [
            ("order", "1", "order.created", {"total": 5}, {"tenant": "t1"})
        ]


@pytest.mark.pooled
def test_event_rolls_back_with_the_business_write(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        with pytest.raises(RuntimeError), conn.transaction():
            conn.execute("INSERT INTO orders VALUES (1)")
            enqueue(conn, "order", "1", "order.created", {"total": 5})
            raise RuntimeError("the business logic failed after enqueueing")
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (0,)
        assert outbox_rows(conn) == []


@pytest.mark.pooled
async def test_async_enqueue_commits_and_rolls_back_with_the_transaction(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        store = AsyncOutboxStore()
        id1 = await aenqueue(conn, "order", "1", "order.created", [1, 2])
        await conn.commit()
        await store.enqueue(conn, "order", "2", "order.created", None)
        await conn.rollback()
        cur = await conn.execute("SELECT id, payload FROM pgonce.outbox")
        assert await cur.fetchall() == [(id1, [1, 2])]


def test_autocommit_outside_a_transaction_is_refused(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(NotInTransaction):
            enqueue(conn, "order", "1", "order.created", {})
        assert outbox_rows(conn) == []


def test_bad_names_and_headers_are_usage_errors(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(UsageError):
        enqueue(conn, "", "1", "order.created", {})
    with pytest.raises(UsageError):
        enqueue(conn, "order", "1", "order.created", {}, headers={"n": 1})  # type: ignore[dict-item]


def notifications_after(
    conn: psycopg.Connection[Any], listener: psycopg.Connection[Any]
) -> list[str]:
    """The channels notified so far, ended by a marker sent after everything before it."""
    listener.execute("LISTEN marker")
    conn.execute("SELECT pg_notify('marker', '')")
    seen = []
    for note in listener.notifies(timeout=5):
        if note.channel == "marker":
            break
        seen.append(note.channel)
    return seen


def test_one_notification_per_transaction_and_none_for_a_rollback(dsn: str) -> None:
    with (
        psycopg.connect(dsn, autocommit=True) as listener,
        psycopg.connect(dsn, autocommit=True) as conn,
    ):
        listener.execute(
            sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel("pgonce", "outbox")))
        )
        OutboxStore().set_waiting(conn, "relay-1", True)
        with pytest.raises(RuntimeError), conn.transaction():
            enqueue(conn, "order", "0", "order.created", {})
            raise RuntimeError("rolled back")
        with conn.transaction():
            for n in range(5):
                enqueue(conn, "order", str(n), "order.created", {})
        assert notifications_after(conn, listener) == ["pgonce.outbox"]


def test_no_notification_while_no_relay_waits(dsn: str) -> None:
    """NOTIFY serializes commits; with every relay busy (none registered) enqueue sends none."""
    store = OutboxStore()
    with (
        psycopg.connect(dsn, autocommit=True) as listener,
        psycopg.connect(dsn, autocommit=True) as conn,
    ):
        listener.execute(
            sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel("pgonce", "outbox")))
        )
        store.set_waiting(conn, "relay-1", True)
        store.set_waiting(conn, "relay-1", False)
        with conn.transaction():
            enqueue(conn, "order", "1", "order.created", {})
        # A registration older than a minute is a relay that died waiting.
        store.set_waiting(conn, "relay-2", True)
        conn.execute("UPDATE pgonce.outbox_waiting_relays SET since = now() - interval '2 min'")
        with conn.transaction():
            enqueue(conn, "order", "2", "order.created", {})
        assert notifications_after(conn, listener) == []


async def test_transactions_of_one_aggregate_get_ids_in_commit_order(dsn: str) -> None:
    """The second writer of an aggregate waits for the first; another aggregate does not."""
    first = await psycopg.AsyncConnection.connect(dsn)
    second = await psycopg.AsyncConnection.connect(dsn)
    other = await psycopg.AsyncConnection.connect(dsn)
    watcher = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        # The second transaction starts first and allocates nothing yet; the first enqueues.
        await second.execute("SELECT 1")
        first_id = await aenqueue(first, "order", "42", "order.created", {})
        second_pid = second.info.backend_pid
        blocked = asyncio.create_task(aenqueue(second, "order", "42", "order.paid", {}))

        async def second_is_waiting_on_a_lock() -> bool:
            cur = await watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (second_pid,)
            )
            row = await cur.fetchone()
            return row == ("Lock",)

        await wait_until(second_is_waiting_on_a_lock)
        # Another aggregate is not held up by them.
        other_id = await aenqueue(other, "order", "43", "order.created", {})
        await other.commit()
        assert not blocked.done()
        await first.commit()
        second_id = await blocked
        await second.commit()
        assert first_id < other_id < second_id
    finally:
        for c in (first, second, other, watcher):
            await c.close()


def test_store_counts_and_replay_on_the_sync_connection(conn: psycopg.Connection[Any]) -> None:
    store = OutboxStore()
    enqueue(conn, "order", "1", "order.created", {})
    conn.commit()
    counts = store.counts(conn)
    assert (counts.pending, counts.parked, counts.published) == (1, 0, 0)
    conn.execute("UPDATE pgonce.outbox SET parked_at = now()")
    assert store.counts(conn).parked == 1
    assert len(store.replay(conn)) == 1
    conn.commit()
    assert store.counts(conn).pending == 1
