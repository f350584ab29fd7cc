"""pgonce.contrib.sqlalchemy on real sessions: claims, outbox events and inbox handlers commit with
the session's transaction, and roll back with it."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from pgonce import Response, fingerprint
from pgonce.contrib.sqlalchemy import (
    NotPsycopgSession,
    async_enqueue,
    async_once,
    enqueue,
    once,
)
from tests.keys.helpers import sqlalchemy_url
from tests.sqlalchemy_adapter.models import Order

FP = fingerprint("POST", "/orders", b'{"amount": 42}')
CREATED = Response(201, (("content-type", "application/json"),), b'{"order": "k"}')


class Failure(Exception):
    pass


def counts(dsn: str) -> tuple[int, int, int]:
    """(orders, keys, outbox rows), as another connection sees them."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM pgonce.keys),"
            " (SELECT count(*) FROM pgonce.outbox)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def test_once_commits_orm_writes_claim_and_response_with_the_session(
    dsn: str, engine: Engine
) -> None:
    with Session(engine) as session, session.begin():
        with once(session, "tenant", "k", FP) as op:
            assert op.won
            session.add(Order(key="k", amount=42))  # pending: once() flushes it
            op.respond(CREATED)
        assert op.stored
        assert counts(dsn) == (0, 0, 0)  # nothing visible before the session commits
    assert counts(dsn) == (1, 1, 0)
    with Session(engine) as session, session.begin():
        with once(session, "tenant", "k", FP) as again:
            assert again.replayed
        assert session.scalar(select(func.count()).select_from(Order)) == 1
    assert again.response == CREATED


def test_a_rollback_of_the_session_frees_the_key(dsn: str, engine: Engine) -> None:
    with pytest.raises(Failure), Session(engine) as session, session.begin():
        session.add(Order(key="before"))
        with once(session, "tenant", "k", FP) as op:
            session.add(Order(key="k"))
            op.respond(CREATED)
        enqueue(session, "order", "k", "order.created", {"key": "k"})
        raise Failure
    assert counts(dsn) == (0, 0, 0)
    with Session(engine) as session, session.begin(), once(session, "tenant", "k", FP) as retry:
        assert retry.won


def test_an_exception_in_the_block_undoes_the_block_only(dsn: str, engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        session.add(Order(key="before"))
        session.flush()
        with pytest.raises(Failure), once(session, "tenant", "k", FP):
            raise Failure
    assert counts(dsn) == (1, 0, 0)


def test_enqueue_commits_with_the_session(dsn: str, engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        session.add(Order(key="k"))
        message_id = enqueue(session, "order", "k", "order.created", {"key": "k"})
    assert message_id > 0
    assert counts(dsn) == (1, 0, 1)


def _savepoint_rolled_back(session: Session) -> None:
    """A nested transaction that failed: its ROLLBACK TO SAVEPOINT makes psycopg, which holds
    prepared statements of its own here, send DEALLOCATE ALL."""
    with pytest.raises(Failure), session.begin_nested():
        session.add(Order(key="abandoned"))
        session.flush()
        raise Failure


def test_once_completes_after_a_nested_transaction_rolled_back(dsn: str, engine: Engine) -> None:
    # The fixture's engine made the tables. prepare_threshold=0: psycopg prepares every
    # statement of the session at once, so the rolled-back savepoint inside the block removes
    # pgonce's prepared completion as well.
    preparing = create_engine(sqlalchemy_url(dsn), connect_args={"prepare_threshold": 0})
    try:
        for key in ("warm", "k"):  # warm: the claim and the completion prepared, then used
            with Session(preparing) as session, session.begin():
                with once(session, "tenant", key, FP) as op:
                    assert op.won
                    session.add(Order(key=key))
                    if key == "k":
                        _savepoint_rolled_back(session)
                    op.respond(CREATED)
                assert op.stored
    finally:
        preparing.dispose()
    assert counts(dsn) == (2, 2, 0)


async def test_async_once_completes_after_a_nested_transaction_rolled_back(
    dsn: str, engine: Engine
) -> None:
    preparing = create_async_engine(sqlalchemy_url(dsn), connect_args={"prepare_threshold": 0})
    try:
        for key in ("warm", "k"):
            async with AsyncSession(preparing) as session, session.begin():
                async with async_once(session, "tenant", key, FP) as op:
                    assert op.won
                    session.add(Order(key=key))
                    if key == "k":
                        await session.run_sync(_savepoint_rolled_back)
                    op.respond(CREATED)
                assert op.stored
    finally:
        await preparing.dispose()
    assert counts(dsn) == (2, 2, 0)


async def test_async_once_and_enqueue(dsn: str, async_engine: AsyncEngine) -> None:
    async with (
        AsyncSession(async_engine) as session,
        session.begin(),
        async_once(session, "tenant", "k", FP) as op,
    ):
        assert op.won
        session.add(Order(key="k"))
        await async_enqueue(session, "order", "k", "order.created", [1, 2])
        op.respond(CREATED)
    assert counts(dsn) == (1, 1, 1)
    with pytest.raises(Failure):
        async with AsyncSession(async_engine) as session, session.begin():
            async with async_once(session, "tenant", "k2", FP) as op:
                session.add(Order(key="k2"))
                op.respond(CREATED)
            raise Failure
    assert counts(dsn) == (1, 1, 1)
    async with (
        AsyncSession(async_engine) as session,
        session.begin(),
        async_once(session, "tenant", "k", FP) as again,
    ):
        assert again.replayed
    assert again.response == CREATED


def test_a_session_on_another_driver_is_refused_with_the_scheme_to_use() -> None:
    engine = create_engine("sqlite://")
    with (
        Session(engine) as session,
        pytest.raises(NotPsycopgSession) as refused,
        once(session, "tenant", "k", FP),
    ):
        pytest.fail("the block ran")
    assert "sqlite+pysqlite" in str(refused.value)
    assert "postgresql+psycopg://" in str(refused.value)


async def test_an_asyncpg_session_is_refused_with_the_scheme_to_use(dsn: str) -> None:
    engine = create_async_engine(sqlalchemy_url(dsn, "asyncpg"))
    try:
        async with AsyncSession(engine) as session:
            with pytest.raises(
                NotPsycopgSession, match=r"postgresql\+asyncpg.*postgresql\+psycopg://"
            ):
                await async_enqueue(session, "order", "k", "order.created", {})
    finally:
        await engine.dispose()
