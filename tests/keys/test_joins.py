"""once() joins the caller's transaction and never ends it; commit=True is the explicit owner.

Here a raw psycopg connection with autocommit off (psycopg opens the transaction at the first
statement, and ``conn.commit()`` ends it); tests/sqlalchemy_adapter/test_joins.py holds the same
for SQLAlchemy's ``Session`` and ``AsyncSession``, which leave the connection idle until their
first statement. In each, an exception after the block in the caller's transaction must roll back
the claim and the block's writes together with everything else.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import IsolationLevel
from psycopg.pq import TransactionStatus

from pgonce import AsyncKeyStore, KeyStore, NotInTransaction, Response, UsageError, fingerprint

FP = fingerprint("POST", "/orders", b'{"amount": 42}')
CREATED = Response(201, (("content-type", "application/json"),), b'{"id": 1}')


class Failure(Exception):
    """What the caller's code raises after the block, still inside its transaction."""


@pytest.fixture
def orders(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (key text PRIMARY KEY)")


def state(dsn: str, key: str) -> tuple[int, int]:
    """(orders with ``key``, claims of ``key``), as another connection sees them."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute(
            "SELECT (SELECT count(*) FROM orders WHERE key = %s),"
            " (SELECT count(*) FROM pgonce.keys WHERE key = %s)",
            (key, key),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


class TestRawConnection:
    def test_an_exception_after_the_block_rolls_back_claim_and_writes(
        self, dsn: str, orders: None, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        assert conn.info.transaction_status == TransactionStatus.IDLE
        with pytest.raises(Failure):
            with store.once(conn, "s", "k", FP) as op:
                assert op.won
                conn.execute("INSERT INTO orders VALUES ('k')")
                op.respond(CREATED)
            raise Failure
        assert conn.info.transaction_status != TransactionStatus.IDLE  # still the caller's
        conn.rollback()
        assert state(dsn, "k") == (0, 0)
        with store.once(conn, "s", "k", FP) as retry:
            assert retry.won

    def test_the_callers_commit_commits_claim_writes_and_response(
        self, dsn: str, orders: None, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        with store.once(conn, "s", "k", FP) as op:
            conn.execute("INSERT INTO orders VALUES ('k')")
            op.respond(CREATED)
        assert op.stored
        assert state(dsn, "k") == (0, 0)  # nothing is visible before the caller commits
        conn.commit()
        assert state(dsn, "k") == (1, 1)
        with store.once(conn, "s", "k", FP) as again:
            assert again.replayed
        assert again.response == CREATED

    def test_an_exception_in_the_block_rolls_back_only_the_block(
        self, dsn: str, orders: None, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        conn.execute("INSERT INTO orders VALUES ('before')")
        with pytest.raises(Failure), store.once(conn, "s", "k", FP):
            conn.execute("INSERT INTO orders VALUES ('k')")
            raise Failure
        conn.commit()
        assert state(dsn, "before") == (1, 0)
        assert state(dsn, "k") == (0, 0)

    def test_an_unstored_response_rolls_back_only_the_block(
        self, dsn: str, orders: None, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        conn.execute("INSERT INTO orders VALUES ('before')")
        with store.once(conn, "s", "k", FP) as op:
            conn.execute("INSERT INTO orders VALUES ('k')")
            op.execute("INSERT INTO orders VALUES ('queued')")
            op.respond(Response(503, (), b"try later"))
        assert not op.stored
        assert conn.info.transaction_status == TransactionStatus.INTRANS  # the caller's, usable
        conn.execute("INSERT INTO orders VALUES ('after')")
        conn.commit()
        assert [state(dsn, k) for k in ("before", "k", "queued", "after")] == [
            (1, 0),
            (0, 0),
            (0, 0),
            (1, 0),
        ]
        with store.once(conn, "s", "k", FP) as retry:
            assert retry.won  # the key stayed free

    def test_the_transaction_is_opened_with_the_connections_settings(
        self, orders: None, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        conn.isolation_level = IsolationLevel.SERIALIZABLE
        with store.once(conn, "s", "k", FP) as op:
            level = conn.execute("SHOW transaction_isolation").fetchone()
            op.respond(CREATED)
        assert level == ("serializable",)
        conn.commit()

    def test_an_autocommit_connection_has_nothing_to_join(
        self, dsn: str, orders: None, store: KeyStore
    ) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            with (
                pytest.raises(NotInTransaction, match="commit=True"),
                store.once(conn, "s", "k", FP),
            ):
                pytest.fail("the block ran")
            with conn.transaction(), store.once(conn, "s", "k", FP) as op:
                op.respond(CREATED)
        assert state(dsn, "k") == (0, 1)

    def test_commit_true_refuses_the_callers_transaction(
        self, dsn: str, orders: None, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        conn.execute("INSERT INTO orders VALUES ('before')")
        with (
            pytest.raises(UsageError, match="idle connection"),
            store.once(conn, "s", "k", FP, commit=True),
        ):
            pytest.fail("the block ran")
        conn.rollback()
        assert state(dsn, "before") == (0, 0)

    def test_commit_true_owns_its_transaction(
        self, dsn: str, orders: None, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        with store.once(conn, "s", "k", FP, commit=True) as op:
            conn.execute("INSERT INTO orders VALUES ('k')")
            op.respond(CREATED)
        assert conn.info.transaction_status == TransactionStatus.IDLE
        assert state(dsn, "k") == (1, 1)

    async def test_async_an_exception_after_the_block_rolls_back(
        self, dsn: str, orders: None, aconn: psycopg.AsyncConnection[Any], astore: AsyncKeyStore
    ) -> None:
        with pytest.raises(Failure):
            async with astore.once(aconn, "s", "k", FP) as op:
                await aconn.execute("INSERT INTO orders VALUES ('k')")
                op.respond(CREATED)
            raise Failure
        await aconn.rollback()
        assert state(dsn, "k") == (0, 0)
        async with astore.once(aconn, "s", "k", FP) as retry:
            await aconn.execute("INSERT INTO orders VALUES ('k')")
            retry.respond(CREATED)
        await aconn.commit()
        assert state(dsn, "k") == (1, 1)
