"""Webhooks that turn into outbox events: a handler that enqueues an event in the worker's
transaction (the common chaining of the inbox to the outbox). The event commits with the
delivery's done mark and only then: a handler that fails after its enqueue, and the batch it rolls
back, leave no event behind, and each delivery's event is in the outbox exactly once, in the
order the handlers' transactions committed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from pgonce import AsyncOutboxStore
from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source, statuses
from tests.inbox.test_worker import deliver, delivery


async def test_a_handlers_event_commits_once_with_its_delivery(dsn: str) -> None:
    outbox = AsyncOutboxStore()
    failures = {"e2": 1}

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        async with conn.transaction():  # a savepoint of the handler's own
            await outbox.enqueue(conn, "order", "42", "order.paid", {"delivery": event.id})
        if failures.get(event.id, 0) > 0:
            failures[event.id] -= 1
            raise RuntimeError("the payment service answered 503")

    await deliver(dsn, *(delivery(f"e{n}", {"n": n}) for n in (1, 2, 3)))
    worker = InboxWorker([source(handler=handler)], dsn=dsn, schema=SCHEMA)
    now = datetime.now(UTC)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        first = await worker.run_once(conn, now=now)  # e2 fails: the batch rolls back
        second = await worker.run_once(conn, now=now)  # e1 and e3, one savepoint each
        later = await worker.run_once(conn, now=now + timedelta(hours=2))  # e2's retry
        cur = await conn.execute(
            "SELECT payload->>'delivery' FROM pgonce.outbox WHERE aggregateid = '42' ORDER BY id"
        )
        events = [r[0] for r in await cur.fetchall()]
    assert (first.retried, second.done, later.done) == (1, 2, 1)
    assert statuses(dsn) == {"e1": "done", "e2": "done", "e3": "done"}
    assert events == ["e1", "e3", "e2"]
