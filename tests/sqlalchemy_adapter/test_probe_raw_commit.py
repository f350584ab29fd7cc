"""A commit or rollback of the psycopg connection under a session, inside once()'s block.

The session's own commit is refused there (test_probe_commit_in_block.py); the connection under
it is the same transaction: its commit() committed the claim without its response, the key stayed
in flight until it expired, and SQLAlchemy's end of the block's savepoint then failed with its own
OperationalError. Now its commit() is refused as the session's is, and a transaction ended in SQL
(or by the connection's rollback()) gets what pgonce's core gives a joined block that ended its
transaction: a UsageError, the committed claim's response stored or the rolled back key free.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from pgonce import Response, fingerprint
from pgonce.contrib.sqlalchemy import BlockCommitRefused, async_once, once
from pgonce.errors import UsageError
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order

FP = fingerprint("POST", "/orders", b"{}")
CREATED = Response(201, body=b"created")
ENDED = "ended inside its block"


def _retry(session: Session) -> tuple[bool, Response | None]:
    with once(session, "t", "k", FP) as op:
        if op.won:
            session.add(Order(key="retry"))
            op.respond(CREATED)
    session.commit()
    return op.won, op.response


@pytest.mark.parametrize("through", ["psycopg", "pool"])
def test_a_commit_of_the_connection_under_the_session_is_refused(
    dsn: str, engine: Engine, through: str
) -> None:
    with Session(engine) as session:
        with pytest.raises(BlockCommitRefused), once(session, "t", "k", FP) as op:
            session.add(Order(key="a"))
            session.flush()
            pooled = session.connection().connection
            if through == "psycopg":
                pooled.driver_connection.commit()  # type: ignore[union-attr]
            else:
                pooled.commit()
            op.respond(CREATED)
        assert stored(dsn) == ([], [])
        session.rollback()
        assert _retry(session)[0]
        # After the block the connection's commit is its own again.
        session.connection().connection.driver_connection.commit()  # type: ignore[union-attr]
    assert stored(dsn) == (["retry"], [("k", 201)])


async def test_async_a_commit_of_the_connection_under_the_session_is_refused(
    dsn: str, async_engine: AsyncEngine
) -> None:
    async with AsyncSession(async_engine) as session:
        with pytest.raises(BlockCommitRefused):
            async with async_once(session, "t", "k", FP) as op:
                session.add(Order(key="a"))
                await session.flush()
                raw = await session.connection()
                driver = (await raw.get_raw_connection()).driver_connection
                await driver.commit()  # type: ignore[union-attr]
                op.respond(CREATED)
        assert stored(dsn) == ([], [])
        await session.rollback()
    assert stored(dsn) == ([], [])


def test_a_commit_in_sql_stores_the_committed_claims_response(dsn: str, engine: Engine) -> None:
    with Session(engine) as session:
        with (
            pytest.raises(UsageError, match=ENDED),
            session.begin(),
            once(session, "t", "k", FP) as op,
        ):
            session.add(Order(key="a"))
            session.execute(text("COMMIT"))  # flushes "a" first (autoflush)
            op.respond(CREATED)
        assert stored(dsn) == (["a"], [("k", 201)])  # not in flight: a retry replays
        won, response = _retry(session)
        assert not won
        assert response == CREATED
    assert stored(dsn) == (["a"], [("k", 201)])


def test_a_commit_in_sql_with_objects_left_unwritten_stores_nothing(
    dsn: str, engine: Engine
) -> None:
    with Session(engine) as session:
        with (
            pytest.raises(UsageError, match="not flushed yet"),
            session.begin(),
            once(session, "t", "k", FP) as op,
        ):
            session.add(Order(key="a"))
            session.execute(text("COMMIT"))
            session.add(Order(key="b"))  # pending: never written, in no transaction
            op.respond(CREATED)
        # A replay of the response would answer for "b" too: the claim stays in flight.
        assert stored(dsn) == (["a"], [("k", None)])
        assert _retry(session) == (False, None)
    assert stored(dsn) == (["a"], [("k", None)])


@pytest.mark.parametrize("how", ["sql", "psycopg"])
def test_a_rollback_under_the_session_frees_the_key(dsn: str, engine: Engine, how: str) -> None:
    with Session(engine) as session:
        with pytest.raises(UsageError, match=ENDED), once(session, "t", "k", FP) as op:
            session.add(Order(key="a"))
            session.flush()
            if how == "sql":
                session.execute(text("ROLLBACK"))
            else:
                session.connection().connection.driver_connection.rollback()  # type: ignore[union-attr]
            op.respond(CREATED)
        assert stored(dsn) == ([], [])
        assert _retry(session)[0]  # the session goes on, and the key is free
    assert stored(dsn) == (["retry"], [("k", 201)])


def test_a_block_that_raises_after_a_rollback_keeps_its_error(dsn: str, engine: Engine) -> None:
    with Session(engine) as session:
        with pytest.raises(KeyError), once(session, "t", "k", FP):
            session.add(Order(key="a"))
            session.flush()
            session.execute(text("ROLLBACK"))
            raise KeyError("the block's own")
        assert _retry(session)[0]
    assert stored(dsn) == (["retry"], [("k", 201)])
