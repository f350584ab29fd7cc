"""An order and its outbox event written from a session whose orders may go through another
engine than the events (``binds=`` per mapper), and what other connections see committed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from pgonce.contrib.sqlalchemy import enqueue
from pgonce.errors import UsageError
from tests.sqlalchemy_adapter.models import Order, orders_and_rows

#: What the commit of a session with events on one connection and writes on another is told.
REFUSED = "enqueued outbox events and wrote on another connection"


def committed(dsn: str) -> tuple[list[str], int]:
    """The orders' keys and the number of outbox events, as another connection sees them."""
    return orders_and_rows(dsn, "outbox")


def order_and_event(session: Session, key: str = "k") -> None:
    """Add the order ``key`` to the session and enqueue the event that tells of it."""
    session.add(Order(key=key))
    enqueue(session, "order", key, "order.created", {})


@contextmanager
def written(engine: Engine, orders: Engine) -> Iterator[Session]:
    """A session with its events on ``engine`` and its orders on ``orders`` (the same engine
    again, or another), in which an order and its event are written."""
    with Session(bind=engine, binds={Order: orders}) as session:
        order_and_event(session)
        yield session


def assert_commit_refused(engine: Engine, orders: Engine, dsn: str, match: str) -> None:
    """The commit of a session of :func:`written` is a UsageError matching ``match``, and
    nothing of it commits."""
    with written(engine, orders) as session, pytest.raises(UsageError, match=match):
        session.commit()
    assert committed(dsn) == ([], 0)
