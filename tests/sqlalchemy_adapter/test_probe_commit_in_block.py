"""A commit of the session's transaction inside once()'s block is refused before it commits.

The block's claim is in flight until the block's end stores its response: a session.commit() (or
a commit of the session's connection) inside the block would commit the claim without it, and the
block's later writes go on in a new transaction, without the claim's savepoint, so the key stayed
in flight until it expired. Real sessions on a real PostgreSQL, counted from another connection.
"""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from pgonce import Response, fingerprint
from pgonce.contrib.sqlalchemy import (
    BlockCommitRefused,
    TransactionEndRefused,
    async_once,
    inbox_handler,
    once,
    process_batch,
)
from pgonce.core.inbox import InboxEvent
from pgonce.errors import UsageError
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.test_inbox import deliver as async_deliver
from tests.sqlalchemy_adapter.test_inbox_sync import POLICY, T0, deliver, inbox

FP = fingerprint("POST", "/orders", b"{}")
CREATED = Response(201, body=b"created")
REFUSED = "inside once"


def test_a_session_commit_inside_the_block_is_refused_and_commits_nothing(
    dsn: str, engine: Engine
) -> None:
    with Session(engine) as session:  # autobegin: the session's commit ends the transaction
        with pytest.raises(UsageError, match=REFUSED), once(session, "t", "k", FP) as op:
            session.add(Order(key="a"))
            session.commit()
            session.add(Order(key="b"))  # would go on in a new transaction
            op.respond(CREATED)
        assert stored(dsn) == ([], [])
        session.rollback()
        with once(session, "t", "k", FP) as op:  # the key is free: the retry runs
            assert op.won
            session.add(Order(key="a"))
            op.respond(CREATED)
        session.commit()
    assert stored(dsn) == (["a"], [("k", 201)])


def test_a_commit_of_the_sessions_connection_inside_the_block_is_refused(
    dsn: str, engine: Engine
) -> None:
    with Session(engine) as session, session.begin():
        with pytest.raises(UsageError, match=REFUSED), once(session, "t", "k", FP) as op:
            session.add(Order(key="a"))
            session.connection().commit()
            op.respond(CREATED)
        assert stored(dsn) == ([], [])
        session.rollback()
    assert stored(dsn) == ([], [])


def test_a_caught_refusal_leaves_the_block_whole(dsn: str, engine: Engine) -> None:
    scoped = scoped_session(sessionmaker(engine))
    with scoped.begin():
        with once(scoped, "t", "k", FP) as op:  # type: ignore[arg-type]
            scoped.add(Order(key="a"))
            with pytest.raises(UsageError, match=REFUSED):
                scoped.commit()
            with pytest.raises(UsageError, match=REFUSED):
                scoped.connection().commit()
            op.respond(CREATED)
        assert stored(dsn) == ([], [])
    assert stored(dsn) == (["a"], [("k", 201)])
    # After the block the session's own commit is the session's again.
    scoped.add(Order(key="b"))
    scoped.commit()
    scoped.connection().commit()
    scoped.remove()
    assert stored(dsn) == (["a", "b"], [("k", 201)])


def test_a_nested_block_keeps_the_outer_blocks_refusal(dsn: str, engine: Engine) -> None:
    with Session(engine) as session, session.begin(), once(session, "t", "outer", FP) as outer:
        with once(session, "t", "inner", FP) as inner:
            session.add(Order(key="inner"))
            inner.respond(CREATED)
        with pytest.raises(UsageError, match=REFUSED):
            session.commit()
        session.add(Order(key="outer"))
        outer.respond(CREATED)
    assert stored(dsn) == (["inner", "outer"], [("inner", 201), ("outer", 201)])


async def test_async_a_commit_inside_the_block_is_refused_and_commits_nothing(
    dsn: str, async_engine: AsyncEngine
) -> None:
    async with AsyncSession(async_engine) as session:
        with pytest.raises(UsageError, match=REFUSED):
            async with async_once(session, "t", "k", FP) as op:
                session.add(Order(key="a"))
                await session.commit()
                op.respond(CREATED)
        with pytest.raises(UsageError, match=REFUSED):
            async with async_once(session, "t", "k", FP) as op:
                session.add(Order(key="a"))
                await (await session.connection()).commit()
                op.respond(CREATED)
        assert stored(dsn) == ([], [])
        await session.rollback()
        async with async_once(session, "t", "k", FP) as op:
            assert op.won
            session.add(Order(key="a"))
            op.respond(CREATED)
        await session.commit()
    assert stored(dsn) == (["a"], [("k", 201)])


def test_a_block_in_a_batch_handler_puts_the_batchs_refusal_back(dsn: str, engine: Engine) -> None:
    deliver(dsn, "e1", "e2")
    refusals: list[type[UsageError]] = []

    def handle(event: InboxEvent, session: Session) -> None:
        with once(session, "t", event.id, FP) as op:
            session.add(Order(key=event.id))
            for end in (session.commit, session.connection().commit):
                with pytest.raises(UsageError) as refused:
                    end()
                refusals.append(type(refused.value))
            op.respond(CREATED)
        with pytest.raises(TransactionEndRefused):
            session.connection().commit()
        session.commit()  # the handler's savepoint, as before the block

    assert process_batch(engine, "shop", handle, retry=POLICY, now=T0) == 2
    assert refusals == [BlockCommitRefused] * 4
    assert inbox(dsn) == {"e1": ("done", 0), "e2": ("done", 0)}
    assert stored(dsn) == (["e1", "e2"], [("e1", 201), ("e2", 201)])


async def test_a_block_in_an_async_inbox_handler_puts_the_workers_refusal_back(
    dsn: str, async_engine: AsyncEngine
) -> None:
    await async_deliver(dsn, "e1", "e2")
    refusals: list[type[UsageError]] = []

    async def handle(event: InboxEvent, session: AsyncSession) -> None:
        async with async_once(session, "t", event.id, FP) as op:
            session.add(Order(key=event.id))
            with pytest.raises(UsageError) as refused:
                await session.commit()
            refusals.append(type(refused.value))
            with pytest.raises(UsageError) as refused:
                await (await session.connection()).commit()
            refusals.append(type(refused.value))
            op.respond(CREATED)
        with pytest.raises(TransactionEndRefused):
            await (await session.connection()).commit()

    worker = InboxWorker([source(handler=inbox_handler(handle))], dsn=dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        assert (await worker.run_once(conn, now=T0)).done == 2
    assert refusals == [BlockCommitRefused] * 4
    assert stored(dsn) == (["e1", "e2"], [("e1", 201), ("e2", 201)])
