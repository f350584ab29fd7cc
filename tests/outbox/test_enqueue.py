"""enqueue() on real PostgreSQL: the event commits or rolls back with the business write."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pgonce.core.channels import notify_channel
from pgonce.core.outbox import OutboxEvent
from pgonce.errors import NotInTransaction, UsageError
from pgonce.store._async.outbox import AsyncOutboxStore
from pgonce.store._async.outbox import enqueue as aenqueue
from pgonce.store._sync.outbox import OutboxStore, enqueue, enqueue_many
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
    with pytest.raises(UsageError, match="must be JSON-encodable"):
        enqueue(conn, "order", "1", "order.created", {"at": object()})


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


@pytest.mark.pooled
def test_enqueue_many_writes_the_events_in_order_in_one_statement(
    conn: psycopg.Connection[Any],
) -> None:
    store = OutboxStore()
    events = [
        OutboxEvent("order", "7", "order.created", {"n": 0}),
        ("order", "8", "order.created", {"n": 1}, {"tenant": "acme"}),
        OutboxEvent("order", "7", "order.paid", {"n": 2}),
    ]
    ids = store.enqueue_many(conn, events)
    assert ids == sorted(ids)
    assert len(set(ids)) == 3
    rows = conn.execute(
        "SELECT id, aggregateid, type, payload, headers FROM pgonce.outbox ORDER BY id"
    ).fetchall()
    assert rows == [
        (ids[0], "7", "order.created", {"n": 0}, {}),
        (ids[1], "8", "order.created", {"n": 1}, {"tenant": "acme"}),
        (ids[2], "7", "order.paid", {"n": 2}, {}),
    ]
    # One lock row per aggregate, counting its events.
    assert conn.execute(
        "SELECT aggregateid, events FROM pgonce.outbox_aggregates ORDER BY 1"
    ).fetchall() == [("7", 2), ("8", 1)]
    assert store.enqueue_many(conn, []) == []
    conn.rollback()
    assert outbox_rows(conn) == []


async def test_async_enqueue_many_and_unordered_enqueue(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        store = AsyncOutboxStore()
        ids = await store.enqueue_many(
            conn, (OutboxEvent("order", str(n), "order.created", n) for n in range(3))
        )
        unordered = await store.enqueue(conn, "audit", "1", "seen", {}, ordered=False)
        await conn.commit()
        cur = await conn.execute("SELECT id, payload FROM pgonce.outbox ORDER BY id")
        assert await cur.fetchall() == [(ids[0], 0), (ids[1], 1), (ids[2], 2), (unordered, {})]
        # ordered=False writes no lock row.
        cur = await conn.execute("SELECT aggregatetype FROM pgonce.outbox_aggregates")
        assert {r[0] for r in await cur.fetchall()} == {"order"}


def test_unordered_statements_keep_the_order_given_and_notify_a_waiting_relay(dsn: str) -> None:
    """ordered=False runs statements of their own, without the lock row: the ids still follow
    the order given, and a waiting relay is still woken, once per transaction."""
    with (
        psycopg.connect(dsn, autocommit=True) as listener,
        psycopg.connect(dsn, autocommit=True) as conn,
    ):
        listener.execute(
            sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel("pgonce", "outbox")))
        )
        OutboxStore().set_waiting(conn, "relay-1", True)
        with conn.transaction():
            ids = enqueue_many(
                conn,
                [
                    OutboxEvent("audit", "9", "seen", {"n": 0}),
                    OutboxEvent("audit", "8", "seen", {"n": 1}, {"tenant": "acme"}),
                    OutboxEvent("audit", "9", "seen", {"n": 2}),
                ],
                ordered=False,
            )
            single = enqueue(conn, "audit", "9", "seen", {"n": 3}, ordered=False)
        assert notifications_after(conn, listener) == ["pgonce.outbox"]
        rows = conn.execute(
            "SELECT id, aggregateid, payload, headers FROM pgonce.outbox ORDER BY id"
        ).fetchall()
        assert rows == [
            (ids[0], "9", {"n": 0}, {}),
            (ids[1], "8", {"n": 1}, {"tenant": "acme"}),
            (ids[2], "9", {"n": 2}, {}),
            (single, "9", {"n": 3}, {}),
        ]
        assert conn.execute("SELECT count(*) FROM pgonce.outbox_aggregates").fetchone() == (0,)


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ("order", "sequence of OutboxEvent"),
        ({"aggregatetype": "order"}, "sequence of OutboxEvent"),
        (None, "sequence of OutboxEvent"),
        ([("order", "1", "created")], "event 0 must be an OutboxEvent .* of 3 fields"),
        ([OutboxEvent("order", "1", "created", {}), ["order"]], "event 1 must be an OutboxEvent"),
        ([OutboxEvent("", "1", "created", {})], "aggregatetype must be 1 to 255 bytes"),
        ([OutboxEvent("order", 1, "created", {})], "aggregateid must be a str"),  # type: ignore[arg-type]
        ([OutboxEvent("order", "1", "created", {}, {"n": 1})], "headers must be str names"),  # type: ignore[dict-item]
        ([OutboxEvent("order", "1", "created", {"at": object()})], "must be JSON-encodable"),
    ],
)
def test_bad_batches_are_usage_errors_and_write_nothing(
    conn: psycopg.Connection[Any], events: Any, message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        enqueue_many(conn, events)
    assert outbox_rows(conn) == []


def test_bad_ordered_flags_and_autocommit_batches_are_refused(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(NotInTransaction):
            enqueue_many(conn, [OutboxEvent("order", "1", "created", {})])
        with conn.transaction():
            with pytest.raises(UsageError, match="ordered must be True or False"):
                enqueue(conn, "order", "1", "created", {}, ordered=1)  # type: ignore[arg-type]
            with pytest.raises(UsageError, match="ordered must be True or False"):
                enqueue_many(conn, [], ordered="yes")  # type: ignore[arg-type]
        assert outbox_rows(conn) == []


async def test_a_batch_waits_for_another_producer_of_one_of_its_aggregates(dsn: str) -> None:
    """enqueue_many takes every aggregate's lock before its first id: the batch's ids all follow
    the ids of a transaction that held one of its aggregates when it started."""
    first = await psycopg.AsyncConnection.connect(dsn)
    batch = await psycopg.AsyncConnection.connect(dsn)
    watcher = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    try:
        held = await aenqueue(first, "order", "2", "order.created", {})
        events = [OutboxEvent("order", "1", "a", {}), OutboxEvent("order", "2", "b", {})]
        blocked = asyncio.create_task(AsyncOutboxStore().enqueue_many(batch, events))
        batch_pid = batch.info.backend_pid

        async def batch_is_waiting_on_a_lock() -> bool:
            cur = await watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (batch_pid,)
            )
            return await cur.fetchone() == ("Lock",)

        await wait_until(batch_is_waiting_on_a_lock)
        await first.commit()
        ids = await blocked
        await batch.commit()
        assert held < min(ids)
    finally:
        for c in (first, batch, watcher):
            await c.close()


async def test_unordered_events_do_not_wait_for_another_producer(dsn: str) -> None:
    first = await psycopg.AsyncConnection.connect(dsn)
    second = await psycopg.AsyncConnection.connect(dsn)
    try:
        await aenqueue(first, "order", "42", "order.created", {})
        # Would wait until first ends, were it ordered.
        await asyncio.wait_for(
            aenqueue(second, "order", "42", "order.noted", {}, ordered=False), timeout=10
        )
        await second.commit()
        await first.commit()
    finally:
        for c in (first, second):
            await c.close()


def test_enqueue_after_psycopg_deallocated_every_prepared_statement(dsn: str) -> None:
    # psycopg sends DEALLOCATE ALL after a ROLLBACK (here a nested transaction() that failed)
    # while it holds prepared statements of its own (prepare_threshold=0: at once). enqueue()'s
    # statement is psycopg's to prepare and forget, so the next enqueue of the same transaction
    # is prepared again rather than run under a name the server no longer has.
    with psycopg.connect(dsn, prepare_threshold=0) as conn:
        with conn.transaction():
            enqueue(conn, "order", "1", "order.created", {"n": 1})
            with contextlib.suppress(psycopg.errors.DivisionByZero), conn.transaction():
                conn.execute("SELECT 1 / 0")
            prepared = "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s"
            assert conn.execute(prepared, ("%pgonce.outbox_aggregates%",)).fetchone() == (0,)
            enqueue(conn, "order", "1", "order.updated", {"n": 2})
        assert [row[2] for row in outbox_rows(conn)] == ["order.created", "order.updated"]


def test_marks_counted_in_the_callers_pipeline(dsn: str) -> None:
    """In psycopg's pipeline a row count arrives with the sync: the store waits for it."""
    store = OutboxStore()
    with psycopg.connect(dsn) as conn:
        enqueue(conn, "order", "1", "order.created", {"total": 5})
        conn.commit()
        with conn.pipeline():
            ids = [message.id for message in store.claim(conn, limit=10)]
            assert store.mark_published(conn, ids) == 1
            assert store.mark_published(conn, ids) == 0  # already published
        conn.commit()


@pytest.mark.parametrize(
    ("payload", "headers", "message"),
    [
        ({"note": "a\x00b"}, None, "payload must not contain a NUL character"),
        ({"note": "\ud800"}, None, r"payload must not contain a lone surrogate \(\\ud800\)"),
        ({"note": "x\udfff"}, None, "payload must not contain a lone surrogate"),
        ({"amount": float("nan")}, None, "must be JSON-encodable"),
        (float("inf"), None, "must be JSON-encodable"),
        ({}, {"traceparent": "\x00"}, "headers must not contain a NUL character"),
        ({}, {"tag": "\udc80"}, "headers must not contain a lone surrogate"),
    ],
)
def test_what_jsonb_refuses_is_a_usage_error_and_the_transaction_goes_on(
    conn: psycopg.Connection[Any], payload: Any, headers: Any, message: str
) -> None:
    # Refused before anything is sent: the caller's transaction is not aborted by it.
    conn.execute("SELECT 1")
    with pytest.raises(UsageError, match=message):
        enqueue(conn, "order", "1", "order.created", payload, headers=headers)
    with pytest.raises(UsageError, match=message):
        enqueue_many(conn, [OutboxEvent("order", "1", "created", payload, headers)])
    assert conn.execute("SELECT 1").fetchone() == (1,)
    conn.commit()
    assert outbox_rows(conn) == []


def test_text_that_only_looks_like_a_refused_escape_is_stored_as_given(
    conn: psycopg.Connection[Any],
) -> None:
    payload = {"path": "C:\\u0000\\ud800", "smile": "\U0001f600", "pair": "\ud83d\ude00"}
    enqueue(conn, "order", "1", "order.created", payload, headers={"h": "\\u0000"})
    enqueue_many(conn, [OutboxEvent("order", "1", "created", payload)])
    conn.commit()
    rows = outbox_rows(conn)
    assert [r[3] for r in rows] == [
        {"path": "C:\\u0000\\ud800", "smile": "\U0001f600", "pair": "\U0001f600"}
    ] * 2
    assert rows[0][4] == {"h": "\\u0000"}
