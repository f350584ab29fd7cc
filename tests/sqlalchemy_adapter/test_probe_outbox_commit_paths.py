"""Outbox events enqueued from a ``Session`` whose ORM writes go through a second engine
(``binds=``): every way of committing the events is refused with a UsageError, not only
``session.commit()``. A commit of the session's connection, or of the second engine's, after a
flush; a ``session.begin()`` block left with a savepoint still open: each would commit one
connection's transaction apart from the other's. Nothing of either commits.
"""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from pgonce.contrib.sqlalchemy import async_enqueue, enqueue
from pgonce.errors import UsageError
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.outbox_engines import REFUSED, committed, written


def idle_in_transaction(dsn: str) -> int:
    """How many other connections of the database are left inside a transaction."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_commit_of_the_sessions_connection_after_a_flush_is_refused(
    engine: Engine, other: Engine, dsn: str
) -> None:
    with written(engine, other) as session:
        session.flush()
        with pytest.raises(UsageError, match=REFUSED):
            session.connection().commit()
    assert committed(dsn) == ([], 0)
    assert idle_in_transaction(dsn) == 0


def test_a_commit_of_the_other_engines_connection_is_refused(
    engine: Engine, other: Engine, dsn: str
) -> None:
    with Session(bind=engine, binds={Order: other}) as session:
        session.add(Order(key="k"))
        session.flush()
        enqueue(session, "order", "k", "order.created", {})
        with pytest.raises(UsageError, match=REFUSED):
            session.connection(bind_arguments={"mapper": Order}).commit()
    assert committed(dsn) == ([], 0)


def test_a_begin_block_left_with_a_savepoint_open_is_refused(
    engine: Engine, other: Engine, dsn: str
) -> None:
    with (
        Session(bind=engine, binds={Order: other}) as session,
        pytest.raises(UsageError, match=REFUSED),
        session.begin(),
    ):
        enqueue(session, "order", "k", "order.created", {})
        session.begin_nested()
        session.add(Order(key="k"))
    assert committed(dsn) == ([], 0)
    with (
        Session(bind=engine, binds={Order: other}) as session,
        pytest.raises(UsageError, match=REFUSED),
        session.begin(),
    ):
        session.begin_nested()
        session.add(Order(key="k"))
        session.flush()
        enqueue(session, "order", "k", "order.created", {})
    assert committed(dsn) == ([], 0)


def test_a_session_commit_with_a_savepoint_open_is_refused(
    engine: Engine, other: Engine, dsn: str
) -> None:
    with Session(bind=engine, binds={Order: other}) as session:
        enqueue(session, "order", "k", "order.created", {})
        session.begin_nested()
        session.add(Order(key="k"))
        session.flush()
        with pytest.raises(UsageError, match=REFUSED):
            session.commit()
    assert committed(dsn) == ([], 0)


def test_one_engine_still_commits_through_its_connection(engine: Engine, dsn: str) -> None:
    with written(engine, engine) as session:
        session.flush()
        session.connection().commit()
    assert committed(dsn) == (["k"], 1)


async def test_async_a_commit_of_the_sessions_connection_is_refused(
    async_engine: AsyncEngine, async_other: AsyncEngine, dsn: str
) -> None:
    async with AsyncSession(bind=async_engine, binds={Order: async_other}) as session:
        session.add(Order(key="k"))
        await async_enqueue(session, "order", "k", "order.created", {})
        await session.flush()
        connection = await session.connection()
        with pytest.raises(UsageError, match=REFUSED):
            await connection.commit()
    assert committed(dsn) == ([], 0)
    assert idle_in_transaction(dsn) == 0
