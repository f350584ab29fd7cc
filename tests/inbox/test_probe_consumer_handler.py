"""Handlers an idempotent consumer cannot run, refused with a UsageError that says why, on a real
database: not a late TypeError after the claim (a handler that is not callable, or a plain def,
whose None cannot be awaited), nor a DatabaseUnavailable for a handler that closed the
connection it was given, which a consumer takes for an outage and retries for ever. In each
case nothing is committed: the message's claim is free for a redelivery."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce.consumers import IdempotentConsumer, Outcome
from pgonce.errors import DatabaseUnavailable, UsageError


async def effect(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute("SELECT 1")


async def handled_later(dsn: str, consumer: IdempotentConsumer, message_id: str) -> Outcome:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        return await consumer.handle(conn, message_id, b"{}", effect)


async def test_a_handler_that_is_not_callable_is_refused_before_the_claim(dsn: str) -> None:
    consumer = IdempotentConsumer("orders")
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        with pytest.raises(UsageError, match="async def"):
            await consumer.handle(conn, "m1", b"{}", "ship_order")  # type: ignore[arg-type]
    assert await handled_later(dsn, consumer, "m1") is Outcome.PROCESSED


async def test_a_plain_def_handler_is_a_usage_error_and_commits_nothing(dsn: str) -> None:
    consumer = IdempotentConsumer("orders")
    ran: list[str] = []

    def handler(conn: psycopg.AsyncConnection[Any]) -> None:
        ran.append("shipped")

    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        with pytest.raises(UsageError, match="async def"):
            await consumer.handle(conn, "m1", b"{}", handler)  # type: ignore[arg-type]
    assert ran == ["shipped"]
    assert await handled_later(dsn, consumer, "m1") is Outcome.PROCESSED


async def test_a_handler_that_closes_its_connection_is_a_usage_error(dsn: str) -> None:
    consumer = IdempotentConsumer("orders")

    async def handler(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.close()

    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        with pytest.raises(UsageError, match="closed the connection") as raised:
            await consumer.handle(conn, "m1", b"{}", handler)
    assert not isinstance(raised.value, DatabaseUnavailable)
    assert await handled_later(dsn, consumer, "m1") is Outcome.PROCESSED
