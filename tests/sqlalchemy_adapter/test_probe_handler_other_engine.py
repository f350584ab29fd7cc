"""An inbox handler whose session writes through another engine than the batch's (a
``session_factory`` with ``binds=`` per mapper): those writes commit on their own, at the
handler's ``session.commit()``, whatever becomes of the batch that marks the event done. A batch
lost after that (its connection cut) leaves the event pending with its writes committed, and the
redelivery runs the handler again. process_batch() and inbox_handler() fail such a handler with
a UsageError (its writes rolled back on both connections, the failure recorded): nothing of the
event commits unless it is marked done with it.
"""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
)
from sqlalchemy.orm import Session, sessionmaker

from pgonce.contrib.sqlalchemy import inbox_handler, process_batch
from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.test_inbox import T0, deliver, orders
from tests.sqlalchemy_adapter.test_inbox_sync import POLICY, inbox

REFUSED = "UsageError"


def last_error(dsn: str, event_id: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT last_error FROM {SCHEMA}.inbox WHERE event_id = %s", (event_id,)
        ).fetchone()
    assert row is not None
    return str(row[0])


async def test_a_batch_cut_after_a_handler_wrote_elsewhere_commits_none_of_it(
    dsn: str, engine: Engine, other: Engine
) -> None:
    await deliver(dsn, "e1")
    await deliver(dsn, "cut")  # after e1

    def handle(event: InboxEvent, session: Session) -> None:
        if event.id == "cut":  # the batch's connection is lost before its COMMIT
            session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        session.add(Order(key=event.id))

    factory = sessionmaker(binds={Order: other})
    with pytest.raises(Exception):  # noqa: B017 - the lost connection, as SQLAlchemy says it
        process_batch(engine, "shop", handle, session_factory=factory, retry=POLICY, now=T0)
    # The event is pending, to be delivered again: none of its handler's writes committed.
    assert inbox(dsn) == {"e1": ("pending", 0), "cut": ("pending", 0)}
    assert orders(dsn) == []


async def test_a_sync_handler_writing_elsewhere_fails_and_commits_nothing(
    dsn: str, engine: Engine, other: Engine
) -> None:
    await deliver(dsn, "e1")

    def handle(event: InboxEvent, session: Session) -> None:
        session.add(Order(key=event.id))

    factory = sessionmaker(binds={Order: other})
    assert process_batch(engine, "shop", handle, session_factory=factory, retry=POLICY, now=T0)
    assert inbox(dsn) == {"e1": ("pending", 1)}
    assert last_error(dsn, "e1").startswith(REFUSED)
    assert orders(dsn) == []


async def test_an_async_handler_writing_elsewhere_fails_and_commits_nothing(
    dsn: str, async_engine: AsyncEngine, async_other: AsyncEngine
) -> None:
    await deliver(dsn, "e1")

    async def handle(event: InboxEvent, session: AsyncSession) -> None:
        session.add(Order(key=event.id))

    factory = async_sessionmaker(binds={Order: async_other})
    handler = inbox_handler(handle, session_factory=factory)
    worker = InboxWorker([source(handler=handler)], dsn=dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        result = await worker.run_once(conn, now=T0)
    assert result.done == 0
    assert last_error(dsn, "e1").startswith(REFUSED)
    assert orders(dsn) == []
