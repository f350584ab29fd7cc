"""The inbox store on real PostgreSQL: batch outcomes, one notification per batch, concurrent
batches, and the refusal of autocommit connections."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from datetime import datetime
from typing import Any

import psycopg
import pytest

from pgonce.cli import main
from pgonce.core.inbox import DeadLetter, Delivery, digest
from pgonce.errors import NotInTransaction, UsageError
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.store._sync.inbox import InboxStore
from tests.inbox.conftest import SCHEMA


def delivery(event_id: str, body: bytes, source: str = "shop") -> Delivery:
    return Delivery(source, event_id, body, {"x-signature": "s"}, digest(body))


@pytest.mark.pooled
def test_a_batch_stores_new_events_and_tells_duplicates_from_conflicts(
    conn: psycopg.Connection[Any],
) -> None:
    store = InboxStore(schema=SCHEMA)
    with conn.transaction():
        first = store.store(conn, [delivery("a", b"1"), delivery("b", b"2"), delivery("a", b"1")])
    assert first == ["stored", "stored", "duplicate"]
    with conn.transaction():
        again = store.store(
            conn,
            [
                delivery("a", b"1"),
                delivery("b", b"other"),
                delivery("c", b"3"),
                delivery("a", b"x"),
            ],
        )
    assert again == ["duplicate", "conflict", "stored", "conflict"]
    # The same event id in another source is another event.
    with conn.transaction():
        assert store.store(conn, [delivery("a", b"9", source="github")]) == ["stored"]
    assert store.counts(conn) == {("github", "pending"): 1, ("shop", "pending"): 3}


def test_one_notification_per_stored_batch_and_none_for_duplicates(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    store = InboxStore(schema=SCHEMA)
    with psycopg.connect(dsn, autocommit=True) as listener:
        store.listen(listener)
        with conn.transaction():
            store.set_waiting(conn, "worker-1", True)
        with conn.transaction():
            store.store(conn, [delivery(f"e{i}", b"x%d" % i) for i in range(50)])
        with conn.transaction():
            store.store(conn, [delivery("e1", b"x1")])  # a duplicate: nothing new to process
        heard = list(listener.notifies(timeout=0.5))
    assert [n.channel for n in heard] == ["pgonce.inbox"]


def test_no_notification_while_no_worker_waits(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """NOTIFY serializes commits; with every worker busy (none registered) a store sends none."""
    store = InboxStore(schema=SCHEMA)
    with psycopg.connect(dsn, autocommit=True) as listener:
        store.listen(listener)
        with conn.transaction():
            store.set_waiting(conn, "worker-1", True)
            store.set_waiting(conn, "worker-1", False)
        with conn.transaction():
            assert store.store(conn, [delivery("a", b"1")]) == ["stored"]
        # A registration older than a minute is a worker loop that died waiting.
        with conn.transaction():
            store.set_waiting(conn, "worker-2", True)
            conn.execute(
                f"UPDATE {SCHEMA}.inbox_waiting_workers SET since = now() - interval '2 min'"
            )
        with conn.transaction():
            assert store.store(conn, [delivery("b", b"2")]) == ["stored"]
        assert list(listener.notifies(timeout=0.5)) == []


def test_writes_refuse_an_autocommit_connection(dsn: str) -> None:
    store = InboxStore(schema=SCHEMA)
    with psycopg.connect(dsn, autocommit=True) as auto, pytest.raises(NotInTransaction):
        store.store(auto, [delivery("a", b"1")])


@pytest.mark.parametrize(
    ("deliveries", "now", "message"),
    [
        ((d for d in [delivery("a", b"1")]), None, "must be a list of Delivery, not a generator"),
        ([replace(delivery("a", b"1"), ordering="k")], None, "ordering must be an Ordering"),  # type: ignore[arg-type]
        ([replace(delivery("a", b"1"), headers={"x": object()})], None, "mapping of str to str"),  # type: ignore[dict-item]
        ([replace(delivery("a", b"1"), event_id=7)], None, "source and event_id must be str"),  # type: ignore[arg-type]
        ([replace(delivery("a", b"1"), body="1")], None, "body and digest must be bytes"),  # type: ignore[arg-type]
        ([delivery("a", b"1")], datetime(2026, 1, 1), "must be timezone-aware"),
        ([delivery("a", b"1")], "2026-01-01", "now must be a datetime or None, not a str"),
    ],
)
def test_store_refuses_what_it_cannot_write_at_the_call(
    conn: psycopg.Connection[Any], deliveries: Any, now: Any, message: str
) -> None:
    with conn.transaction(), pytest.raises(UsageError, match=message):
        InboxStore(schema=SCHEMA).store(conn, deliveries, now=now)


def test_fail_refuses_a_decision_that_is_not_one(conn: psycopg.Connection[Any]) -> None:
    store = InboxStore(schema=SCHEMA)
    with conn.transaction():
        store.store(conn, [delivery("a", b"1")])
    with conn.transaction():
        (event,) = store.claim(conn, "shop", limit=1)
        with pytest.raises(UsageError, match="the decision must be Retry or DeadLetter"):
            store.fail(conn, event, None, "boom")  # type: ignore[arg-type]
        store.fail(conn, event, DeadLetter(), "a NUL\x00 from a payload")
    found = store.get(conn, "shop", "a")
    assert found is not None
    assert (found["status"], found["last_error"]) == ("dead", "a NUL? from a payload")


@pytest.mark.pooled
async def test_concurrent_overlapping_batches_neither_deadlock_nor_double_store(dsn: str) -> None:
    store = AsyncInboxStore(schema=SCHEMA)
    ids = [f"evt_{i}" for i in range(40)]

    async def one_batch(seed: int) -> list[str]:
        shuffled = ids[:]
        random.Random(seed).shuffle(shuffled)
        async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
            deliveries = [delivery(i, i.encode()) for i in shuffled]
            outcomes = await store.store(conn, deliveries)
            await asyncio.sleep(0.01)  # hold the row locks a little
            return [i for i, o in zip(shuffled, outcomes, strict=True) if o == "stored"]

    results = await asyncio.gather(*(one_batch(seed) for seed in range(8)))
    stored = [i for batch in results for i in batch]
    assert sorted(stored) == sorted(ids)


def test_cli_replays_dead_letters(dsn: str, conn: psycopg.Connection[Any]) -> None:
    store = InboxStore(schema=SCHEMA)
    with conn.transaction():
        store.store(conn, [delivery("a", b"1"), delivery("b", b"2")])
        conn.execute(
            f"UPDATE {SCHEMA}.inbox SET status = 'dead', attempts = 3, processed_at = now()"
        )
    assert main(["replay", "--dsn", dsn, "--source", "shop", "--event-id", "b"]) == 0
    assert main(["replay", "--dsn", dsn, "--source", "shop", "--event-id", "b"]) == 1
    rows = conn.execute(f"SELECT event_id, status, attempts FROM {SCHEMA}.inbox ORDER BY 1")
    assert rows.fetchall() == [("a", "dead", 3), ("b", "pending", 0)]
    conn.commit()
