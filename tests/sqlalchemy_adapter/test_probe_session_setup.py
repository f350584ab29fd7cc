"""Sessions set up in ways that give pgonce no transaction to join, or no one engine for it,
are refused with a pgonce error that says what to change, and write nothing.

A ``Session(autobegin=False)`` used outside its ``begin()`` raised SQLAlchemy's own
InvalidRequestError from deep inside the call; a session with ``binds=`` per mapper and no
``bind=`` of its own was told that it was "bound to no engine", which it is not.
"""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import Engine
from sqlalchemy.exc import PendingRollbackError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from pgonce import fingerprint
from pgonce.contrib.sqlalchemy import async_enqueue, async_once, enqueue, once
from pgonce.errors import NotInTransaction, UsageError
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order

FP = fingerprint("POST", "/orders", b"{}")


def test_a_session_without_autobegin_outside_its_begin_is_not_in_a_transaction(
    engine: Engine, dsn: str
) -> None:
    key = uuid.uuid4().hex
    with Session(engine, autobegin=False) as session:
        with (
            pytest.raises(NotInTransaction, match=r"autobegin=False.*session\.begin\(\)"),
            once(session, "t", key, FP),
        ):
            pytest.fail("the block ran")
        with pytest.raises(NotInTransaction, match="autobegin=False"):
            enqueue(session, "order", key, "order.created", {})
        # Inside its begin() the same session claims, and commits with it.
        with session.begin(), once(session, "t", key, FP) as op:
            assert op.won
            session.add(Order(key=key, amount=1))
    assert stored(dsn) == ([key], [(key, None)])


async def test_an_async_session_without_autobegin_is_not_in_a_transaction(
    async_engine: AsyncEngine, dsn: str
) -> None:
    key = uuid.uuid4().hex
    async with AsyncSession(async_engine, autobegin=False) as session:
        with pytest.raises(NotInTransaction, match="autobegin=False"):
            async with async_once(session, "t", key, FP):
                pytest.fail("the block ran")
        with pytest.raises(NotInTransaction, match="autobegin=False"):
            await async_enqueue(session, "order", key, "order.created", {})
    assert stored(dsn) == ([], [])


def test_a_session_that_must_roll_back_first_is_a_usage_error_over_sqlalchemys(
    engine: Engine,
) -> None:
    # As the core store says a failed transaction; SQLAlchemy's own error is the cause.
    key = uuid.uuid4().hex
    with Session(engine) as session:
        session.add(Order(key=key))
        session.add(Order(key=key))
        with pytest.raises(Exception, match="orders_key_key"):
            session.flush()
        with (
            pytest.raises(UsageError, match=r"has failed.*session\.rollback\(\)") as raised,
            once(session, "t", key, FP),
        ):
            pytest.fail("the block ran")
        assert isinstance(raised.value.__cause__, PendingRollbackError)
        with pytest.raises(UsageError, match="has failed"):
            enqueue(session, "order", key, "order.created", {})


def test_a_session_with_binds_per_mapper_only_is_told_to_give_its_engine_as_bind(
    engine: Engine, dsn: str
) -> None:
    key = uuid.uuid4().hex
    with Session(binds={Order: engine}) as session:
        with (
            pytest.raises(UsageError, match=r"binds=.*bind=engine") as raised,
            once(session, "t", key, FP),
        ):
            pytest.fail("the block ran")
        assert "bound to no engine" not in str(raised.value)
        with pytest.raises(UsageError, match="binds="):
            enqueue(session, "order", key, "order.created", {})
    assert stored(dsn) == ([], [])
