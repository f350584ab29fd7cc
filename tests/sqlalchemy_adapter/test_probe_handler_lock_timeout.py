"""A write of an inbox handler that PostgreSQL refuses when pgonce flushes it at the handler's
end (a lock timeout, a deadlock, a serialization failure: OperationalErrors to psycopg) is the
handler's failure, recorded as the same write flushed inside the handler is: SQLAlchemy's error,
not DatabaseUnavailable, which stays for a lost connection.

A real row lock held by another connection, a short lock_timeout, the real inbox worker and
process_batch() on a real PostgreSQL.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import sqlalchemy.exc
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from pgonce.contrib.sqlalchemy import inbox_handler, process_batch
from pgonce.core.inbox import Delivery, InboxEvent, RetryPolicy, digest
from pgonce.errors import DatabaseUnavailable, PgonceError
from pgonce.store._sync.inbox import InboxStore
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source
from tests.keys.helpers import sqlalchemy_url
from tests.sqlalchemy_adapter.models import Order

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
POLICY = RetryPolicy(attempts=3, base=timedelta(seconds=10), cap=timedelta(seconds=15))
FLUSHED = ["in the handler", "at its end"]


def deliver(dsn: str, event_id: str) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction():
        body = json.dumps({"order": event_id}).encode()
        delivery = Delivery("shop", event_id, body, {}, digest(body))
        InboxStore(schema=SCHEMA).store(conn, [delivery], now=T0)


def held_order(dsn: str) -> psycopg.Connection[Any]:
    """A connection holding the lock of the one order's row (in its open transaction)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO orders (key, amount) VALUES ('o', 0)")
    holder = psycopg.connect(dsn)
    holder.execute("SELECT * FROM orders WHERE key = 'o' FOR UPDATE")
    return holder


def recorded(dsn: str) -> tuple[str, int, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT status, attempts, last_error FROM {SCHEMA}.inbox").fetchone()
        amount = conn.execute("SELECT amount FROM orders").fetchone()
    assert row is not None
    assert amount == (0,)  # the handler's write was undone
    return row[0], row[1], row[2]


@pytest.mark.parametrize("flushed", FLUSHED)
async def test_a_lock_timeout_at_the_handlers_end_is_its_failure(
    dsn: str, async_engine: AsyncEngine, flushed: str
) -> None:
    deliver(dsn, "e1")

    async def handle(event: InboxEvent, session: AsyncSession) -> None:
        await session.execute(text("SET LOCAL lock_timeout = '50ms'"))
        order = await session.get(Order, 1)
        assert order is not None
        order.amount = 5
        if flushed == "in the handler":
            await session.flush()

    worker = InboxWorker(
        [source(handler=inbox_handler(handle), retry=POLICY)], dsn=dsn, schema=SCHEMA
    )
    with held_order(dsn):
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            result = await worker.run_once(conn, now=T0)
    assert (result.claimed, result.retried) == (1, 1)
    status, attempts, error = recorded(dsn)
    assert (status, attempts) == ("pending", 1)
    assert error.startswith("OperationalError: (psycopg.errors.LockNotAvailable)"), error


@pytest.mark.parametrize("flushed", FLUSHED)
def test_a_lock_timeout_at_a_batch_handlers_end_is_its_failure(
    dsn: str, engine: Engine, flushed: str
) -> None:
    deliver(dsn, "e1")

    def handle(event: InboxEvent, session: Session) -> None:
        session.execute(text("SET LOCAL lock_timeout = '50ms'"))
        order = session.get(Order, 1)
        assert order is not None
        order.amount = 5
        if flushed == "in the handler":
            session.flush()

    with held_order(dsn):
        assert process_batch(engine, "shop", handle, retry=POLICY, now=T0) == 1
    status, attempts, error = recorded(dsn)
    assert (status, attempts) == ("pending", 1)
    assert error.startswith("OperationalError: (psycopg.errors.LockNotAvailable)"), error


async def test_a_connection_lost_at_the_handlers_end_is_still_unavailable(
    dsn: str, async_engine: AsyncEngine
) -> None:
    async def handle(event: InboxEvent, session: AsyncSession) -> None:
        session.add(Order(key="k"))
        pid = await session.scalar(text("SELECT pg_backend_pid()"))
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))

    event = InboxEvent("shop", "e1", b"{}", {}, 0, T0)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute("SELECT 1")  # the worker's transaction, which the handler runs in
        with pytest.raises(DatabaseUnavailable) as raised:
            await inbox_handler(handle)(event, conn)
    assert raised.value.__cause__ is not None


def test_a_serialization_failure_at_the_batchs_commit_is_sqlalchemys_error(
    dsn: str, engine: Engine
) -> None:
    """A batch on a SERIALIZABLE engine whose COMMIT PostgreSQL refuses (its handler's write and
    another transaction's, committed first, each read what the other wrote): SQLAlchemy's error,
    as the same COMMIT of a Session raises it, the batch rolled back, no attempt counted; not
    DatabaseUnavailable."""
    deliver(dsn, "e1")
    serializable = create_engine(sqlalchemy_url(dsn), isolation_level="SERIALIZABLE")
    other = psycopg.connect(dsn)
    other.execute("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")

    def handle(event: InboxEvent, session: Session) -> None:
        session.scalar(text("SELECT count(*) FROM orders WHERE key = 'a'"))
        other.execute("SELECT count(*) FROM orders WHERE key = 'b'")
        other.execute("INSERT INTO orders (key, amount) VALUES ('a', 0)")
        session.add(Order(key="b"))
        session.flush()
        other.commit()  # the first to commit wins; the batch's COMMIT is refused

    try:
        with pytest.raises(sqlalchemy.exc.OperationalError) as raised:
            process_batch(serializable, "shop", handle, retry=POLICY, now=T0)
    finally:
        other.close()
        serializable.dispose()
    assert not isinstance(raised.value, PgonceError)
    assert isinstance(raised.value.orig, psycopg.errors.SerializationFailure)
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT status, attempts FROM {SCHEMA}.inbox").fetchall()
        orders = conn.execute("SELECT key FROM orders").fetchall()
    assert rows == [("pending", 0)]
    assert orders == [("a",)]
