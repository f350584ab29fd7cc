"""A ``session.begin_nested()`` begun inside once()'s block and left open at its end is refused
with a UsageError that says so; the block's writes roll back, the caller's transaction goes on.

pgonce's savepoint ends the nested transaction's SAVEPOINT with it, and SQLAlchemy's later
RELEASE of it failed: the caller got SQLAlchemy's PendingRollbackError ("Can't reconnect until
invalid savepoint transaction is rolled back"), which named neither the cause nor the fix, and
the session's transaction was left failed. Real sessions on a real PostgreSQL.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from pgonce import Response, fingerprint
from pgonce.contrib.sqlalchemy import async_once, once
from pgonce.errors import UsageError
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order

FP = fingerprint("POST", "/orders", b"{}")
CREATED = Response(201, body=b"created")
OPEN = "begin_nested.. begun inside once..'s block .* was still open"


@pytest.mark.parametrize("depth", [1, 2])
def test_a_nested_transaction_left_open_in_the_block_is_refused(
    dsn: str, engine: Engine, depth: int
) -> None:
    with Session(engine) as session, session.begin():
        session.add(Order(key="before"))
        with pytest.raises(UsageError, match=OPEN), once(session, "t", "k", FP) as op:
            session.add(Order(key="in-block"))
            for level in range(depth):
                session.begin_nested()
                session.add(Order(key=f"open-{level}"))
            op.respond(CREATED)
        # The caller's transaction is usable, and holds nothing of the block.
        assert not session.in_nested_transaction()
        session.add(Order(key="after"))
    assert stored(dsn) == (["after", "before"], [])
    with Session(engine) as session, session.begin(), once(session, "t", "k", FP) as op:
        assert op.won  # the key was left free
        session.add(Order(key="retry"))
        op.respond(CREATED)
    assert stored(dsn) == (["after", "before", "retry"], [("k", 201)])


def test_nested_transactions_ended_in_the_block_still_commit_with_it(
    dsn: str, engine: Engine
) -> None:
    with Session(engine) as session, session.begin(), once(session, "t", "k", FP) as op:
        kept = session.begin_nested()
        session.add(Order(key="kept"))
        kept.commit()
        with session.begin_nested():
            session.add(Order(key="also-kept"))
        undone = session.begin_nested()
        session.add(Order(key="undone"))
        session.flush()
        undone.rollback()
        op.respond(CREATED)
    assert stored(dsn) == (["also-kept", "kept"], [("k", 201)])


async def test_async_a_nested_transaction_left_open_in_the_block_is_refused(
    dsn: str, async_engine: AsyncEngine
) -> None:
    async with AsyncSession(async_engine) as session, session.begin():
        session.add(Order(key="before"))
        with pytest.raises(UsageError, match=OPEN):
            async with async_once(session, "t", "k", FP) as op:
                await session.begin_nested()
                session.add(Order(key="open"))
                op.respond(CREATED)
        assert not session.in_nested_transaction()
    assert stored(dsn) == (["before"], [])
