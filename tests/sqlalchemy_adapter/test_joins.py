"""once() joins a SQLAlchemy session's transaction: plain ``store.once()`` on the psycopg
connection under a ``Session`` or ``AsyncSession``, which leave it idle until their first
statement. An exception after the block, inside ``session.begin()``, rolls back the claim and the
ORM's writes together (tests/keys/test_joins.py holds the raw connection's shapes)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from sqlalchemy import Engine, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from pgonce import AsyncKeyStore, KeyStore
from tests.keys.test_joins import CREATED, FP, Failure, state
from tests.sqlalchemy_adapter.models import Order


def driver_connection(session: Session) -> psycopg.Connection[Any]:
    conn = session.connection().connection.driver_connection
    assert isinstance(conn, psycopg.Connection)
    return conn


class TestSQLAlchemy:
    def test_session_rollback_undoes_claim_and_writes(
        self, dsn: str, engine: Engine, store: KeyStore
    ) -> None:
        with pytest.raises(Failure), Session(engine) as session, session.begin():
            conn = driver_connection(session)
            assert conn.info.transaction_status == TransactionStatus.IDLE
            with store.once(conn, "s", "k", FP) as op:
                session.add(Order(key="k"))
                session.flush()
                op.respond(CREATED)
            raise Failure
        assert state(dsn, "k") == (0, 0)

    def test_session_commit_commits_claim_writes_and_response(
        self, dsn: str, engine: Engine, store: KeyStore
    ) -> None:
        with Session(engine) as session, session.begin():
            conn = driver_connection(session)
            with store.once(conn, "s", "k", FP) as op:
                session.add(Order(key="k"))
                session.flush()
                op.respond(CREATED)
        assert state(dsn, "k") == (1, 1)
        with Session(engine) as session, session.begin():
            conn = driver_connection(session)
            with store.once(conn, "s", "k", FP) as again:
                assert again.replayed
            assert session.scalars(select(Order.key)).all() == ["k"]
        assert again.response == CREATED

    async def test_async_session_rollback_undoes_claim_and_writes(
        self, dsn: str, async_engine: AsyncEngine, astore: AsyncKeyStore
    ) -> None:
        with pytest.raises(Failure):
            async with AsyncSession(async_engine) as session, session.begin():
                connection = await session.connection()
                raw = await connection.get_raw_connection()
                conn = raw.driver_connection
                assert isinstance(conn, psycopg.AsyncConnection)
                async with astore.once(conn, "s", "k", FP) as op:
                    session.add(Order(key="k"))
                    await session.flush()
                    op.respond(CREATED)
                raise Failure
        assert state(dsn, "k") == (0, 0)
        async with AsyncSession(async_engine) as session, session.begin():
            await session.execute(text("INSERT INTO orders (key, amount) VALUES ('other', 0)"))
        assert state(dsn, "other") == (1, 0)
