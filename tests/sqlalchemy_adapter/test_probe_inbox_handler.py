"""inbox_handler() given a plain def: the failure the worker records says what to change.

The handler ran, returned None, and the wrapper awaited it: the worker recorded "TypeError:
object NoneType can't be used in 'await' expression" against each event, retry after retry,
which named neither inbox_handler() nor the fix. Real worker, real PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Awaitable

import psycopg
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from pgonce.contrib.sqlalchemy import inbox_handler
from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.test_inbox import T0, deliver, orders


def last_errors(dsn: str) -> dict[str, str | None]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return dict(conn.execute(f"SELECT event_id, last_error FROM {SCHEMA}.inbox").fetchall())


async def test_a_plain_def_handler_fails_its_event_with_a_usage_error(
    dsn: str, async_engine: AsyncEngine
) -> None:
    await deliver(dsn, "e1")

    def handle(event: InboxEvent, session: AsyncSession) -> None:
        session.add(Order(key=event.id))  # pending only: rolled back with the failure

    worker = InboxWorker(
        [source(handler=inbox_handler(handle))],  # type: ignore[arg-type]
        dsn=dsn,
        schema=SCHEMA,
    )
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        result = await worker.run_once(conn, now=T0)
    assert (result.done, result.retried) == (0, 1)
    assert orders(dsn) == []
    error = last_errors(dsn)["e1"] or ""
    assert error.startswith("UsageError: inbox_handler() runs its handler in the async inbox")
    assert "process_batch()" in error


async def test_a_handler_that_returns_an_awaitable_runs(
    dsn: str, async_engine: AsyncEngine
) -> None:
    await deliver(dsn, "e1")

    async def write(event: InboxEvent, session: AsyncSession) -> None:
        session.add(Order(key=event.id))

    def handle(event: InboxEvent, session: AsyncSession) -> Awaitable[None]:
        return write(event, session)  # a plain def (a lambda, a partial) handing back a coroutine

    worker = InboxWorker([source(handler=inbox_handler(handle))], dsn=dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        assert (await worker.run_once(conn, now=T0)).done == 1
    assert orders(dsn) == ["e1"]
