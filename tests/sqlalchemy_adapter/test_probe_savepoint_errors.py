"""A transaction or a savepoint that the caller's code broke, met by once() on a session, is
said as the core store's once() says it on a psycopg connection, not as a lost server.

A session whose transaction had failed (a statement raised and was caught) got SQLAlchemy's
InternalError from once()'s SAVEPOINT, where the core's once() refuses the failed transaction
with a UsageError; a savepoint ended in the block by the caller (released in SQL, or a
begin_nested() of the caller's rolled back) made the end of once()'s savepoint a
DatabaseUnavailable (PostgreSQL's "savepoint does not exist" is an OperationalError to psycopg)
or SQLAlchemy's ResourceClosedError, where the core says a UsageError. Real sessions on a real
PostgreSQL.
"""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy.exc
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from pgonce import Response, fingerprint
from pgonce.contrib.sqlalchemy import async_once, once
from pgonce.errors import DatabaseError, DatabaseUnavailable, UsageError
from pgonce.store._sync.keys import KeyStore
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order

FP = fingerprint("POST", "/orders", b"{}")
CREATED = Response(201, body=b"created")
FAILED = "has failed"
GONE = "savepoint opened before pgonce's was released or rolled back"


def _fail(session: Session) -> None:
    with pytest.raises(sqlalchemy.exc.DBAPIError):
        session.execute(text("SELECT 1/0"))


def _store(engine: Engine, key: str) -> None:
    with Session(engine) as session, session.begin(), once(session, "t", key, FP) as op:
        session.add(Order(key=key))
        op.respond(CREATED)


def test_a_failed_transaction_is_refused_as_the_core_refuses_it(dsn: str, engine: Engine) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("SELECT 1").close()
        with pytest.raises(psycopg.DataError):
            conn.execute("SELECT 1/0")
        with pytest.raises(UsageError, match="has failed"), KeyStore().once(conn, "t", "k", FP):
            pytest.fail("the core's block ran")
    with Session(engine) as session:
        session.add(Order(key="before"))
        session.flush()
        _fail(session)
        with pytest.raises(UsageError, match=FAILED) as raised, once(session, "t", "k", FP):
            pytest.fail("the block ran")
        assert not isinstance(raised.value, DatabaseUnavailable)
        session.rollback()
        with once(session, "t", "k", FP) as op:  # a new transaction: the key is free
            assert op.won
            session.add(Order(key="k"))
            op.respond(CREATED)
        session.commit()
    assert stored(dsn) == (["k"], [("k", 201)])


async def test_async_a_failed_transaction_is_refused(dsn: str, async_engine: AsyncEngine) -> None:
    async with AsyncSession(async_engine) as session:
        with pytest.raises(sqlalchemy.exc.DBAPIError):
            await session.execute(text("SELECT 1/0"))
        with pytest.raises(UsageError, match=FAILED):
            async with async_once(session, "t", "k", FP):
                pytest.fail("the block ran")
        await session.rollback()
    assert stored(dsn) == ([], [])


def test_a_replay_whose_callers_savepoint_was_released_in_sql_is_a_usage_error(
    dsn: str, engine: Engine
) -> None:
    _store(engine, "k")
    with Session(engine) as session:
        session.begin()
        session.begin_nested()
        with pytest.raises(UsageError, match=GONE) as raised, once(session, "t", "k", FP) as op:
            assert not op.won
            session.execute(text("RELEASE SAVEPOINT sa_savepoint_1"))
        assert not isinstance(raised.value, DatabaseUnavailable)
        cause = raised.value.__cause__
        assert isinstance(cause, sqlalchemy.exc.DBAPIError)
        assert isinstance(cause.orig, psycopg.errors.InvalidSavepointSpecification)
        assert "session's transaction was rolled back" in str(raised.value)
        assert not session.in_transaction()
        session.add(Order(key="after"))  # the session goes on, in a new transaction
        session.commit()
    assert stored(dsn) == (["after", "k"], [("k", 201)])


def test_a_replay_whose_callers_savepoint_was_rolled_back_is_a_usage_error(
    dsn: str, engine: Engine
) -> None:
    _store(engine, "k")
    with Session(engine) as session, session.begin():
        outer = session.begin_nested()
        with pytest.raises(UsageError, match=GONE), once(session, "t", "k", FP) as op:
            assert not op.won
            outer.rollback()  # takes the block's savepoint with it
        session.add(Order(key="after"))  # the session's transaction goes on
    assert stored(dsn) == (["after", "k"], [("k", 201)])


async def test_async_a_replay_whose_callers_savepoint_was_rolled_back_is_a_usage_error(
    dsn: str, async_engine: AsyncEngine, engine: Engine
) -> None:
    _store(engine, "k")
    async with AsyncSession(async_engine) as session, session.begin():
        outer = await session.begin_nested()
        with pytest.raises(UsageError, match=GONE):
            async with async_once(session, "t", "k", FP) as op:
                assert not op.won
                await outer.rollback()
        session.add(Order(key="after"))
    assert stored(dsn) == (["after", "k"], [("k", 201)])


def test_a_replay_whose_transaction_failed_in_the_block_is_the_cores_database_error(
    dsn: str, engine: Engine
) -> None:
    _store(engine, "k")
    with Session(engine) as session:
        with pytest.raises(DatabaseError, match="ending once"), once(session, "t", "k", FP) as op:
            assert not op.won
            _fail(session)
        session.rollback()
    assert stored(dsn) == (["k"], [("k", 201)])
