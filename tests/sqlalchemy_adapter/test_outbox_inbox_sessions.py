"""Handlers and endpoints that reach for the connection under their Session: the batch's
transaction is the batch's to end, for every event it claimed, and the request's the
middleware's."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from examples.sqlalchemy_payments.app import IdempotentSession, create_app
from pgonce.contrib.sqlalchemy import (
    SessionCommitRefused,
    SessionRollbackRefused,
    TransactionEndRefused,
    inbox_handler,
    process_batch,
)
from pgonce.core.inbox import InboxEvent
from pgonce.errors import UsageError
from pgonce.webhooks.worker import InboxWorker
from tests.http.test_http_middleware import keys, payments
from tests.inbox.conftest import SCHEMA, source
from tests.sqlalchemy_adapter.app import insert_payment
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.test_http import HEADERS
from tests.sqlalchemy_adapter.test_inbox import deliver as async_deliver
from tests.sqlalchemy_adapter.test_inbox_sync import POLICY, T0, deliver, inbox, orders


def last_errors(dsn: str) -> dict[str, str | None]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT event_id, last_error FROM {SCHEMA}.inbox").fetchall()
    return dict(rows)


@pytest.mark.parametrize("action", ["commit", "rollback"])
def test_a_handler_that_ends_its_connections_transaction_is_refused_and_the_batch_goes_on(
    dsn: str, engine: Engine, action: str
) -> None:
    deliver(dsn, "e1", "ends", "e3")
    refused: list[UsageError] = []

    def handle(event: InboxEvent, session: Session) -> None:
        session.add(Order(key=event.id))
        session.flush()
        if event.id == "ends":
            try:
                getattr(session.connection(), action)()
            except TransactionEndRefused as error:
                refused.append(error)
                raise

    assert process_batch(engine, "shop", handle, retry=POLICY, now=T0) == 3
    assert len(refused) == 1
    assert f"connection's {action}()" in str(refused[0])
    # e3 ran in the batch's transaction, and committed with it; the refused handler's write
    # was rolled back with its savepoint, and its event is due again.
    assert orders(dsn) == ["e1", "e3"]
    assert inbox(dsn) == {"e1": ("done", 0), "ends": ("pending", 1), "e3": ("done", 0)}
    assert "TransactionEndRefused" in (last_errors(dsn)["ends"] or "")


def test_a_handler_that_catches_the_refusal_commits_with_the_batch(
    dsn: str, engine: Engine
) -> None:
    deliver(dsn, "e1", "e2")

    def handle(event: InboxEvent, session: Session) -> None:
        session.add(Order(key=event.id))
        session.flush()
        with pytest.raises(TransactionEndRefused):
            session.connection().commit()
        session.add(Order(key=event.id + "-after"))

    assert process_batch(engine, "shop", handle, retry=POLICY, now=T0) == 2
    assert orders(dsn) == ["e1", "e1-after", "e2", "e2-after"]
    assert inbox(dsn) == {"e1": ("done", 0), "e2": ("done", 0)}


@pytest.mark.parametrize(
    ("action", "refusal"), [("commit", SessionCommitRefused), ("rollback", SessionRollbackRefused)]
)
def test_an_endpoints_commit_or_rollback_of_its_sessions_connection_is_refused(
    dsn: str, action: str, refusal: type[Exception]
) -> None:
    app = create_app(dsn)

    @app.post("/ends")
    async def ends(session: IdempotentSession) -> dict[str, Any]:
        await insert_payment(session)
        await getattr(await session.connection(), action)()
        await insert_payment(session)
        return {}

    with TestClient(app) as client, pytest.raises(refusal):
        client.post("/ends", json={}, headers=HEADERS)
    with psycopg.connect(dsn, autocommit=True) as db:
        assert (payments(db), keys(db)) == (0, 0)


@pytest.mark.parametrize("action", ["commit", "rollback"])
async def test_an_async_handler_that_ends_its_connections_transaction_is_refused(
    dsn: str, async_engine: AsyncEngine, action: str
) -> None:
    await async_deliver(dsn, "e1", "ends")
    refused: list[UsageError] = []

    async def handle(event: InboxEvent, session: AsyncSession) -> None:
        session.add(Order(key=event.id))
        await session.flush()
        if event.id == "ends":
            try:
                await getattr(await session.connection(), action)()
            except TransactionEndRefused as error:
                refused.append(error)
                raise

    worker = InboxWorker([source(handler=inbox_handler(handle))], dsn=dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        first = await worker.run_once(conn, now=T0)
        assert (first.claimed, first.retried) == (2, 1)
        second = await worker.run_once(conn, now=T0)  # e1 alone, in its own batch
        assert second.done == 1
    assert len(refused) == 1
    assert f"connection's {action}()" in str(refused[0])
    assert orders(dsn) == ["e1"]
    assert inbox(dsn) == {"e1": ("done", 0), "ends": ("pending", 1)}
    assert "TransactionEndRefused" in (last_errors(dsn)["ends"] or "")
