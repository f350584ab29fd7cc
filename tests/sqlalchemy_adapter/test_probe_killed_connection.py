"""The connection under a ``Session`` killed while pgonce works on it (``pg_terminate_backend``
from another connection): pgonce's calls raise DatabaseUnavailable, as the core store does, not
SQLAlchemy's OperationalError, whichever statement (SQLAlchemy's or psycopg's) met the loss
first; SQLAlchemy's error is its ``__cause__``.
"""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy.exc
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from pgonce.contrib.sqlalchemy import enqueue, once, process_batch
from pgonce.core.inbox import InboxEvent
from pgonce.errors import DatabaseUnavailable
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.test_inbox_sync import POLICY, T0, deliver, inbox


def kill(dsn: str, session: Session) -> None:
    """End the backend of ``session``'s connection, and wait until it is gone."""
    pid = session.execute(text("SELECT pg_backend_pid()")).scalar()
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 10000)", (pid,))


def test_once_on_a_killed_connection_is_unavailable(engine: Engine, dsn: str) -> None:
    with Session(engine) as session:
        kill(dsn, session)
        with pytest.raises(DatabaseUnavailable) as raised, once(session, "s", "k", bytes(32)):
            pass
    assert isinstance(raised.value.__cause__, sqlalchemy.exc.DBAPIError | psycopg.Error)


def test_a_connection_killed_in_the_block_is_unavailable_at_its_end(
    engine: Engine, dsn: str
) -> None:
    with (
        Session(engine) as session,
        pytest.raises(DatabaseUnavailable) as raised,
        once(session, "s", "k", bytes(32)),
    ):
        session.add(Order(key="k"))
        kill(dsn, session)
    assert isinstance(raised.value.__cause__, sqlalchemy.exc.DBAPIError | psycopg.Error)


def test_enqueue_on_a_killed_connection_is_unavailable(engine: Engine, dsn: str) -> None:
    with Session(engine) as session:
        kill(dsn, session)
        with pytest.raises(DatabaseUnavailable):
            enqueue(session, "order", "k", "order.created", {})


def test_a_batch_whose_connection_is_killed_in_a_handler_is_unavailable(
    engine: Engine, dsn: str
) -> None:
    deliver(dsn, "e1")

    def handle(event: InboxEvent, session: Session) -> None:
        session.add(Order(key=event.id))
        kill(dsn, session)

    with pytest.raises(DatabaseUnavailable) as raised:
        process_batch(engine, "shop", handle, retry=POLICY, now=T0)
    assert raised.value.__cause__ is not None
    assert inbox(dsn) == {"e1": ("pending", 0)}
