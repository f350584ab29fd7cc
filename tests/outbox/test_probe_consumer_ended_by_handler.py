"""A consumer's handler that ends handle()'s transaction itself (a COMMIT or ROLLBACK in SQL;
psycopg itself refuses ``conn.commit()`` there) on real PostgreSQL: the claim is settled, never
left in flight, so a redelivery of the message is answered, not requeued until the key expires."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from pgonce.consumers import IdempotentConsumer, Outcome
from pgonce.errors import UsageError

Handler = Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]


@pytest.fixture
async def db(dsn: str) -> Any:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("CREATE TABLE effects (message_id text PRIMARY KEY)")
        yield conn


async def effects(conn: psycopg.AsyncConnection[Any]) -> list[str]:
    cur = await conn.execute("SELECT message_id FROM effects ORDER BY message_id")
    return [r[0] for r in await cur.fetchall()]


def record_then(end: str) -> Handler:
    async def handler(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects VALUES ('1')")
        await conn.execute(end)

    return handler


async def _record_again(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute("INSERT INTO effects VALUES ('1')")


@pytest.mark.parametrize("end", ["COMMIT", "END"])
async def test_a_handler_that_committed_leaves_the_message_a_duplicate(
    db: psycopg.AsyncConnection[Any], end: str
) -> None:
    consumer = IdempotentConsumer("shipping")
    with pytest.raises(UsageError) as raised:
        await consumer.handle(db, "1", b"{}", record_then(end))
    message = str(raised.value)
    assert "committed" in message
    assert "duplicate" in message.lower()
    assert await effects(db) == ["1"]  # its commit committed them
    # The claim committed with them is completed: the redelivery is a duplicate to acknowledge,
    # not "in flight" (never handled, never acknowledged) until the key expires.
    assert await consumer.handle(db, "1", b"{}", _record_again) == Outcome.DUPLICATE
    assert db.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


async def test_a_handler_that_rolled_back_leaves_the_message_to_run_again(
    db: psycopg.AsyncConnection[Any],
) -> None:
    consumer = IdempotentConsumer("shipping")
    with pytest.raises(UsageError) as raised:
        await consumer.handle(db, "1", b"{}", record_then("ROLLBACK"))
    assert "rolled back" in str(raised.value)
    assert await effects(db) == []
    assert await consumer.handle(db, "1", b"{}", _record_again) == Outcome.PROCESSED
    assert await effects(db) == ["1"]


async def test_a_handler_that_committed_on_a_connection_with_autocommit_off(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as setup:
        await setup.execute("CREATE TABLE effects (message_id text PRIMARY KEY)")
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        consumer = IdempotentConsumer("shipping")
        with pytest.raises(UsageError):
            await consumer.handle(conn, "1", b"{}", record_then("COMMIT"))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert await consumer.handle(conn, "1", b"{}", _record_again) == Outcome.DUPLICATE
        await conn.rollback()
