"""The aggregates' lock rows: the upsert of a known aggregate's row is a HOT update (0018).

enqueue() moves last_enqueued_at, which outbox_aggregates_by_age indexes, only when it is an hour
behind; every other enqueue of a known aggregate changes no indexed column and, with the room the
fillfactor keeps, stays on its page without an index entry.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from pgonce.core.outbox import OutboxEvent
from pgonce.store._sync.outbox import enqueue, enqueue_many

T0 = datetime(2026, 6, 1, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def lock_row(conn: psycopg.Connection[Any], aggregate: str) -> tuple[Any, ...] | None:
    return conn.execute(
        "SELECT events, last_enqueued_at FROM pgonce.outbox_aggregates WHERE aggregateid = %s",
        (aggregate,),
    ).fetchone()


def updates(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(updates, HOT updates) of outbox_aggregates, as the statistics have them now."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
        " WHERE relid = 'pgonce.outbox_aggregates'::regclass"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_a_known_aggregates_lock_row_is_updated_in_place_and_its_age_to_the_hour(
    dsn: str,
) -> None:
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        psycopg.connect(dsn, autocommit=True) as reader,
    ):
        # The first event creates the row; the next ones within the hour leave its age alone.
        for minutes in range(0, 60, 10):
            with conn.transaction():
                enqueue(conn, "order", "7", "e", {}, now=T0 + minutes * MINUTE)
        with conn.transaction():
            enqueue_many(conn, [OutboxEvent("order", "7", "e", {})] * 2, now=T0 + 59 * MINUTE)
        conn.execute("SELECT pg_stat_force_next_flush()")
        assert lock_row(reader, "7") == (8, T0)
        # Every update so far was HOT: no index entry, the row's page.
        assert updates(reader) == (6, 6)
        # An hour on, the age moves: that update changes an indexed column, so it is not HOT.
        with conn.transaction():
            enqueue(conn, "order", "7", "e", {}, now=T0 + 61 * MINUTE)
        conn.execute("SELECT pg_stat_force_next_flush()")
        assert lock_row(reader, "7") == (9, T0 + 61 * MINUTE)
        assert updates(reader) == (7, 6)
        # A clock that goes back never moves it back.
        with conn.transaction():
            enqueue(conn, "order", "7", "e", {}, now=T0)
        assert lock_row(reader, "7") == (10, T0 + 61 * MINUTE)
