"""The aggregates' lock rows after 0018: the relay deletes those of the aggregates it published,
never one an enqueue holds, and an enqueue waiting behind that deletion still comes after it.

What orders an aggregate's events is the row lock an enqueue holds to its commit; the rows
themselves may go at any time. These tests hold the parts that make deleting them safe: the
deletion skips a held row rather than waiting for it (the relay never queues behind a business
transaction), and an enqueue that meets a row being deleted waits for the deletion's commit and
then inserts the row anew (no unique violation, no second lock row).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg

from pgonce.store._sync.outbox import OutboxStore, enqueue


def lock_rows(conn: psycopg.Connection[Any]) -> dict[str, int]:
    with conn.transaction():
        rows = conn.execute("SELECT aggregateid, events FROM pgonce.outbox_aggregates").fetchall()
    return dict(rows)


def ids_of(conn: psycopg.Connection[Any], aggregate: str) -> list[int]:
    with conn.transaction():
        rows = conn.execute(
            "SELECT id FROM pgonce.outbox WHERE aggregateid = %s ORDER BY id", (aggregate,)
        ).fetchall()
    return [r[0] for r in rows]


def test_publishing_deletes_the_lock_rows_of_aggregates_with_nothing_left_pending(
    dsn: str,
) -> None:
    store = OutboxStore()
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        psycopg.connect(dsn, autocommit=True) as holder,
    ):
        with conn.transaction():
            for aggregate in ["a", "a", "b", "c"]:
                enqueue(conn, "order", aggregate, "e", {})
        (a1, a2), (b1,), (c1,) = ids_of(conn, "a"), ids_of(conn, "b"), ids_of(conn, "c")
        # An enqueue of c in progress holds c's lock row.
        holder.execute("BEGIN")
        c2 = enqueue(holder, "order", "c", "e", {})
        with conn.transaction():
            # A deletion that waited for the held row would fail here instead of skipping it.
            conn.execute("SET LOCAL lock_timeout = '200ms'")
            assert store.mark_published(conn, [a1, b1, c1]) == 3
        # a has a2 pending: its row stays for its next events. b is done: its row went. c's is
        # held: skipped (its count not yet updated for the uncommitted enqueue), and deleted when
        # the batch with c2 is published.
        assert lock_rows(conn) == {"a": 2, "c": 1}
        holder.execute("COMMIT")
        assert lock_rows(conn) == {"a": 2, "c": 2}
        with conn.transaction():
            assert store.mark_published(conn, [a2, c2]) == 2
        assert lock_rows(conn) == {}
        # The next enqueue of an aggregate creates its row again.
        with conn.transaction():
            enqueue(conn, "order", "b", "e", {})
        assert lock_rows(conn) == {"b": 1}


def test_an_enqueue_behind_the_deletion_of_its_lock_row_waits_and_comes_after_it(
    dsn: str,
) -> None:
    store = OutboxStore()
    with (
        psycopg.connect(dsn, autocommit=True) as relay,
        psycopg.connect(dsn, autocommit=True) as producer,
    ):
        with producer.transaction():
            first = enqueue(producer, "order", "d", "e", {"n": 1})
        # The relay's transaction deletes d's lock row and stays open.
        relay.execute("BEGIN")
        assert store.mark_published(relay, [first]) == 1
        relay_pid, producer_pid = relay.info.backend_pid, producer.info.backend_pid
        produced: list[int] = []
        failed: list[BaseException] = []

        def produce() -> None:
            try:
                with producer.transaction():
                    produced.append(enqueue(producer, "order", "d", "e", {"n": 2}))
            except BaseException as error:  # reported by the assertion below
                failed.append(error)

        thread = threading.Thread(target=produce)
        thread.start()
        with psycopg.connect(dsn, autocommit=True) as watcher:
            # The enqueue waits on the relay's transaction: the lock row it met is being deleted.
            blocked = "SELECT %s = ANY(pg_blocking_pids(%s))"
            deadline = time.monotonic() + 10
            while watcher.execute(blocked, (relay_pid, producer_pid)).fetchone() != (True,):
                assert time.monotonic() < deadline, "the enqueue never waited for the relay"
                time.sleep(0.01)
        assert produced == []
        relay.execute("COMMIT")
        thread.join(timeout=10)
        assert failed == []
        # It went on once the deletion committed, with a new lock row and the next id.
        assert len(produced) == 1
        assert produced[0] > first
        assert lock_rows(relay) == {"d": 1}
