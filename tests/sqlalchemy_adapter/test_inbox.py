"""Inbox handlers that take an AsyncSession: the ORM's writes commit with the event's "done", and a
failing handler commits nothing -- on the worker's own connection and transaction."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import psycopg
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from pgonce.contrib.sqlalchemy import inbox_handler
from pgonce.core.inbox import Delivery, InboxEvent, RetryPolicy, digest
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source, statuses
from tests.sqlalchemy_adapter.models import Order

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


async def deliver(dsn: str, *event_ids: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        deliveries = []
        for event_id in event_ids:
            body = json.dumps({"order": event_id}).encode()
            headers = {"content-type": "application/json"}
            deliveries.append(Delivery("shop", event_id, body, headers, digest(body)))
        await AsyncInboxStore(schema=SCHEMA).store(conn, deliveries, now=T0)


def orders(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [row[0] for row in conn.execute("SELECT key FROM orders ORDER BY key")]


async def test_handler_writes_commit_with_done_and_failures_commit_nothing(
    dsn: str, async_engine: AsyncEngine
) -> None:
    await deliver(dsn, "e1", "e2", "boom")
    sessions: list[AsyncSession] = []

    async def handle(event: InboxEvent, session: AsyncSession) -> None:
        sessions.append(session)
        session.add(Order(key=event.payload["order"]))
        await session.flush()
        # The session sees the batch's earlier writes: one transaction, the worker's.
        seen = await session.scalar(select(func.count()).select_from(Order))
        assert seen == len(sessions), "a handler's session is not in the batch's transaction"
        if event.id == "boom":
            raise RuntimeError("the ledger is down")

    policy = RetryPolicy(attempts=3, base=timedelta(seconds=10), cap=timedelta(seconds=15))
    worker = InboxWorker(
        [source(handler=inbox_handler(handle), json_required=True, retry=policy)],
        dsn=dsn,
        schema=SCHEMA,
    )
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        first = await worker.run_once(conn, now=T0)
        # Without savepoints a failure rolls the whole batch back; the worker then goes careful.
        assert (first.claimed, first.retried) == (3, 1)
        assert orders(dsn) == []
        sessions.clear()
        second = await worker.run_once(conn, now=T0)
        assert (second.done, second.retried) == (2, 0)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert orders(dsn) == ["e1", "e2"]
    assert statuses(dsn) == {"e1": "done", "e2": "done", "boom": "pending"}


async def test_a_handlers_commit_and_rollback_stay_inside_the_event(
    dsn: str, async_engine: AsyncEngine
) -> None:
    await deliver(dsn, "kept", "undone")

    async def handle(event: InboxEvent, session: AsyncSession) -> None:
        session.add(Order(key=event.id))
        if event.id == "undone":
            await session.rollback()  # undoes this handler's write, not the worker's batch
        else:
            await session.commit()  # releases the handler's savepoint; the event commits it

    worker = InboxWorker([source(handler=inbox_handler(handle))], dsn=dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        result = await worker.run_once(conn, now=T0)
    assert result.done == 2
    assert orders(dsn) == ["kept"]
    assert statuses(dsn) == {"kept": "done", "undone": "done"}
