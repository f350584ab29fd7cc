"""A block or a claim that loses the transaction it was made in.

once() in the caller's transaction joins it and must not end it; begin()'s claim is completed by
commit() in the transaction begin() opened, on the same connection. Code that ends the
transaction inside the block (conn.commit(), conn.rollback(), a SQL COMMIT), or hands a claim to
commit() on another connection, gets a UsageError that says so, and the key is left as honest as
what the database holds allows: a claim committed with the block's writes is completed with the
block's response (a retry replays it), a claim rolled back leaves the key free.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.pq import TransactionStatus

from pgonce import AsyncKeyStore, InFlight, KeyStore, Response, UsageError, Won, fingerprint

FP = fingerprint("POST", "/orders", b'{"amount": 42}')
CREATED = Response(201, (("content-type", "application/json"),), b'{"id": 1}')
SHORT = timedelta(milliseconds=100)


@pytest.fixture
def orders(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (key text PRIMARY KEY)")


def orders_of(dsn: str, key: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT count(*) FROM orders WHERE key LIKE %s", (key + "%",)).fetchone()
    assert row is not None
    return int(row[0])


def retry(dsn: str, store: KeyStore, key: str) -> Any:
    """What a retry of ``key`` is answered, on a connection of its own (rolled back)."""
    with psycopg.connect(dsn) as c:
        with store.once(c, "s", key, FP, wait=SHORT) as op:
            claim = op.claim
        c.rollback()
    return claim


def commit_by_method(conn: psycopg.Connection[Any]) -> None:
    conn.commit()


def commit_in_sql(conn: psycopg.Connection[Any]) -> None:
    conn.execute("COMMIT")


def rollback_by_method(conn: psycopg.Connection[Any]) -> None:
    conn.rollback()


def rollback_in_sql(conn: psycopg.Connection[Any]) -> None:
    conn.execute("ROLLBACK")


@pytest.mark.parametrize("end", [commit_by_method, commit_in_sql], ids=["commit()", "SQL COMMIT"])
def test_a_commit_inside_a_joined_block_is_refused_and_the_response_stored(
    dsn: str,
    orders: None,
    conn: psycopg.Connection[Any],
    store: KeyStore,
    end: Callable[[psycopg.Connection[Any]], None],
) -> None:
    with (
        pytest.raises(UsageError, match="ended inside its block"),
        store.once(conn, "s", "k", FP) as op,
    ):
        assert op.won
        conn.execute("INSERT INTO orders VALUES ('k')")
        op.execute("INSERT INTO orders VALUES ('k-queued')")
        op.respond(CREATED)
        end(conn)
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert op.stored
    # The claim committed with the block's writes: the response is stored with them (and the
    # block's queued write), so a retry replays it instead of waiting on a claim in flight.
    assert orders_of(dsn, "k") == 2
    answer = retry(dsn, store, "k")
    assert not isinstance(answer, InFlight)
    assert answer.response == CREATED


@pytest.mark.parametrize(
    "end", [rollback_by_method, rollback_in_sql], ids=["rollback()", "SQL ROLLBACK"]
)
def test_a_rollback_inside_a_joined_block_is_refused_and_the_key_left_free(
    dsn: str,
    orders: None,
    conn: psycopg.Connection[Any],
    store: KeyStore,
    end: Callable[[psycopg.Connection[Any]], None],
) -> None:
    with (
        pytest.raises(UsageError, match="claim was rolled back"),
        store.once(conn, "s", "k", FP) as op,
    ):
        conn.execute("INSERT INTO orders VALUES ('k')")
        op.execute("INSERT INTO orders VALUES ('k-queued')")
        op.respond(CREATED)
        end(conn)
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert not op.stored
    assert orders_of(dsn, "k") == 0  # the queued write did not run without its claim
    assert isinstance(retry(dsn, store, "k"), Won)


@pytest.mark.parametrize("end", [commit_by_method, rollback_by_method], ids=["commit", "rollback"])
def test_statements_after_the_end_inside_a_joined_block_are_refused(
    dsn: str,
    orders: None,
    conn: psycopg.Connection[Any],
    store: KeyStore,
    end: Callable[[psycopg.Connection[Any]], None],
) -> None:
    # The block ended the transaction and went on in a new one: the completion would land in
    # that new transaction, apart from the claim. Refused, and the new transaction cannot commit.
    with (
        pytest.raises(UsageError, match="ended inside its block"),
        store.once(conn, "s", "k", FP) as op,
    ):
        conn.execute("INSERT INTO orders VALUES ('k-before')")
        end(conn)
        conn.execute("INSERT INTO orders VALUES ('k-after')")
        op.respond(CREATED)
    assert not op.stored
    conn.rollback()
    if end is commit_by_method:
        # Half of the block's work committed: neither a replay nor a new run would be right.
        assert orders_of(dsn, "k") == 1
        assert isinstance(retry(dsn, store, "k"), InFlight)
    else:
        assert orders_of(dsn, "k") == 0
        assert isinstance(retry(dsn, store, "k"), Won)


async def test_a_commit_inside_an_async_joined_block_is_refused_and_the_response_stored(
    dsn: str, orders: None, aconn: psycopg.AsyncConnection[Any], astore: AsyncKeyStore
) -> None:
    with pytest.raises(UsageError, match="ended inside its block"):
        async with astore.once(aconn, "s", "k", FP) as op:
            await aconn.execute("INSERT INTO orders VALUES ('k')")
            op.respond(CREATED)
            await aconn.commit()
    assert op.stored
    assert orders_of(dsn, "k") == 1
    assert retry(dsn, KeyStore(), "k").response == CREATED


async def test_statements_after_a_rollback_inside_an_async_joined_block_are_refused(
    dsn: str, orders: None, aconn: psycopg.AsyncConnection[Any], astore: AsyncKeyStore
) -> None:
    with pytest.raises(UsageError, match="ended inside its block"):
        async with astore.once(aconn, "s", "k", FP) as op:
            await aconn.rollback()
            await aconn.execute("INSERT INTO orders VALUES ('k')")
            op.respond(CREATED)
    await aconn.rollback()
    assert orders_of(dsn, "k") == 0
    assert isinstance(retry(dsn, KeyStore(), "k"), Won)


def test_commit_after_the_begin_transaction_was_committed_is_refused(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    claim = store.begin(conn, "s", "k", FP)
    assert isinstance(claim, Won)
    conn.commit()
    with pytest.raises(UsageError, match=r"ended before commit\(\)"):
        store.commit(conn, claim, CREATED)


def test_commit_of_another_connections_claim_is_refused(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    with psycopg.connect(dsn) as other:
        mine = store.begin(conn, "s", "a", FP)
        theirs = store.begin(other, "s", "b", FP)
        assert isinstance(mine, Won)
        assert isinstance(theirs, Won)
        # Before: commit() on ``other`` completed nothing (``a``'s claim is not in its
        # transaction) and committed ``other``'s transaction, leaving ``b`` in flight.
        with pytest.raises(UsageError, match="another connection"):
            store.commit(other, mine, CREATED)
        assert other.info.transaction_status == TransactionStatus.INTRANS  # untouched
        assert store.commit(other, theirs, CREATED)
        assert store.commit(conn, mine, CREATED)
        # On an idle connection too: the refusal names the cause, not an ended transaction.
        again = store.begin(conn, "s", "c", FP)
        assert isinstance(again, Won)
        with pytest.raises(UsageError, match="another connection"):
            store.commit(other, again, CREATED)
        conn.rollback()
    assert retry(dsn, store, "a").response == CREATED
    assert retry(dsn, store, "b").response == CREATED


async def test_async_commit_of_another_connections_claim_is_refused(
    dsn: str, aconn: psycopg.AsyncConnection[Any], astore: AsyncKeyStore
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as other:
        mine = await astore.begin(aconn, "s", "a", FP)
        theirs = await astore.begin(other, "s", "b", FP)
        assert isinstance(mine, Won)
        assert isinstance(theirs, Won)
        with pytest.raises(UsageError, match="another connection"):
            await astore.commit(other, mine, CREATED)
        assert await astore.commit(other, theirs, CREATED)
        assert await astore.commit(aconn, mine, CREATED)


@pytest.mark.parametrize("end", ["COMMIT", "ROLLBACK"])
def test_an_end_inside_a_joined_block_in_psycopgs_pipeline_is_refused(
    dsn: str, orders: None, conn: psycopg.Connection[Any], store: KeyStore, end: str
) -> None:
    # Before: psycopg's NoActiveSqlTransaction from its RELEASE, untyped.
    with (
        pytest.raises(UsageError, match="ended inside its block"),
        conn.pipeline(),
        store.once(conn, "s", "k", FP) as op,
    ):
        conn.execute("INSERT INTO orders VALUES ('k')")
        conn.execute(end)
        op.respond(CREATED)
    conn.rollback()
    if end == "COMMIT":
        assert orders_of(dsn, "k") == 1
        assert retry(dsn, store, "k").response == CREATED
    else:
        assert orders_of(dsn, "k") == 0
        assert isinstance(retry(dsn, store, "k"), Won)


class Failure(Exception):
    """What the block raises after it ended the transaction."""


def test_a_block_that_raises_after_ending_the_transaction_says_so(
    dsn: str, orders: None, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    with pytest.raises(Failure) as raised, store.once(conn, "s", "k", FP):
        conn.execute("INSERT INTO orders VALUES ('k')")
        conn.commit()
        raise Failure
    assert any("ended inside its block" in note for note in raised.value.__notes__)
    assert orders_of(dsn, "k") == 1
    assert isinstance(retry(dsn, store, "k"), InFlight)  # no outcome to replay, nor to redo
