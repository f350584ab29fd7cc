"""A ``scoped_session`` given as process_batch()'s ``session_factory`` (or an
``async_scoped_session`` as inbox_handler()'s): the registry hands every event the same
session, which refuses the arguments of the second call, and every event after the first is
recorded as failed, then dead-lettered. Both are refused at the call with a UsageError that
says what to pass instead, before any event is claimed.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, async_scoped_session, async_sessionmaker
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from pgonce.contrib.sqlalchemy import inbox_handler, process_batch
from pgonce.core.inbox import InboxEvent
from pgonce.errors import UsageError
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.test_inbox_sync import POLICY, T0, deliver, inbox, orders

SAY = "sessionmaker"


def test_a_scoped_session_factory_is_refused_before_any_event_is_claimed(
    dsn: str, engine: Engine
) -> None:
    deliver(dsn, "e1", "e2")

    def handle(event: InboxEvent, session: Session) -> None:
        session.add(Order(key=event.id))

    scoped = scoped_session(sessionmaker())
    with pytest.raises(UsageError, match=SAY):
        process_batch(engine, "shop", handle, session_factory=scoped, retry=POLICY, now=T0)
    assert inbox(dsn) == {"e1": ("pending", 0), "e2": ("pending", 0)}
    # Its sessionmaker runs every event.
    assert process_batch(
        engine, "shop", handle, session_factory=scoped.session_factory, retry=POLICY, now=T0
    )
    assert inbox(dsn) == {"e1": ("done", 0), "e2": ("done", 0)}
    assert orders(dsn) == ["e1", "e2"]


def test_an_async_scoped_session_factory_is_refused(async_engine: AsyncEngine) -> None:
    async def handle(event: InboxEvent, session: object) -> None:
        pass

    scoped = async_scoped_session(async_sessionmaker(), scopefunc=lambda: 0)
    with pytest.raises(UsageError, match=SAY):
        inbox_handler(handle, session_factory=scoped)
