"""The SQLAlchemy page says that an ``inbox_handler()`` session's connection refuses ``commit()``
and ``rollback()`` with ``TransactionEndRefused``: the handler fails, nothing of it commits, and
the batch's other events are done."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from pgonce.contrib.sqlalchemy import TransactionEndRefused, inbox_handler
from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source, statuses
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.test_inbox import T0, deliver, orders


@pytest.mark.parametrize("end", ["commit", "rollback"])
async def test_the_sessions_connection_refuses_to_end_the_events_transaction(
    dsn: str, async_engine: AsyncEngine, end: str
) -> None:
    await deliver(dsn, "kept", "ended")
    refused: list[BaseException] = []

    async def handle(event: InboxEvent, session: AsyncSession) -> None:
        session.add(Order(key=event.id))
        await session.flush()
        if event.id == "ended":
            connection = await session.connection()
            try:
                await getattr(connection, end)()
            except TransactionEndRefused as error:
                refused.append(error)
                raise

    worker = InboxWorker([source(handler=inbox_handler(handle))], dsn=dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await worker.run_once(conn, now=T0)
        await worker.run_once(conn, now=T0)  # after a failure the worker runs one at a time
    assert len(refused) >= 1
    assert f"connection's {end}()" in str(refused[0])
    assert orders(dsn) == ["kept"]
    assert statuses(dsn) == {"kept": "done", "ended": "pending"}
