"""A claim() completed, released or committed on another connection than the one it was made on.

The claim's row is in the claiming connection's open transaction, which no other connection
sees: complete() there updated nothing and answered False (as if already completed), release()
deleted nothing, commit() committed the other connection's transaction without it. The claiming
transaction then committed the claim alone, and the key stayed in flight until it expired, with
nothing to say so. Each is refused at the call, as commit() refuses a claim of begin().
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, KeyStore, Response, UsageError, Won, fingerprint

FP = fingerprint("other connection")


def _row(dsn: str) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT response_status, completed_at IS NOT NULL FROM pgonce.keys WHERE key = 'k'"
        ).fetchone()


CALLS: dict[str, Callable[[KeyStore, psycopg.Connection[Any], Won], object]] = {
    "complete": lambda store, conn, claim: store.complete(conn, claim, Response(201, body=b"x")),
    "release": lambda store, conn, claim: store.release(conn, claim),
    "commit": lambda store, conn, claim: store.commit(conn, claim, Response(201, body=b"x")),
}


@pytest.mark.parametrize("call", CALLS)
def test_a_claim_is_refused_on_another_connection(dsn: str, store: KeyStore, call: str) -> None:
    with psycopg.connect(dsn) as claiming, psycopg.connect(dsn) as other:
        claim = store.claim(claiming, "s", "k", FP)
        assert isinstance(claim, Won)
        other.execute("SELECT 1")  # in a transaction of its own, as a pool's next connection
        with pytest.raises(UsageError, match="another connection"):
            CALLS[call](store, other, claim)
        # Nothing was done on the other connection; the claim is still the claiming
        # transaction's, which completes it as it should.
        assert other.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        other.rollback()
        assert store.complete(claiming, claim, Response(201, body=b"x")) is True
        claiming.commit()
    assert _row(dsn) == (201, True)


async def test_the_async_store_refuses_it_too(dsn: str, astore: AsyncKeyStore) -> None:
    async with (
        await psycopg.AsyncConnection.connect(dsn) as claiming,
        await psycopg.AsyncConnection.connect(dsn) as other,
    ):
        claim = await astore.claim(claiming, "s", "k", FP)
        assert isinstance(claim, Won)
        await other.execute("SELECT 1")
        with pytest.raises(UsageError, match="another connection"):
            await astore.complete(other, claim, Response(201, body=b"x"))
        with pytest.raises(UsageError, match="another connection"):
            await astore.release(other, claim)
        with pytest.raises(UsageError, match="another connection"):
            await astore.commit(other, claim, Response(201, body=b"x"))
        await other.rollback()
        assert await astore.complete(claiming, claim, Response(201, body=b"x")) is True
        await claiming.commit()
    assert _row(dsn) == (201, True)


def test_a_claim_completes_on_its_own_connection_as_before(dsn: str, store: KeyStore) -> None:
    with psycopg.connect(dsn) as conn:
        claim = store.claim(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        store.release(conn, claim)
        conn.commit()
        claim = store.claim(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        assert store.commit(conn, claim, Response(201, body=b"x")) is True
    assert _row(dsn) == (201, True)


def test_a_claim_whose_transaction_committed_is_completed_on_any_connection(
    dsn: str, store: KeyStore
) -> None:
    """Once the claiming transaction ended, its claim is everyone's to see: a stuck claim (its
    transaction committed without a response) is completed later on another connection."""
    with psycopg.connect(dsn) as claiming, psycopg.connect(dsn) as other:
        claim = store.claim(claiming, "s", "k", FP)
        assert isinstance(claim, Won)
        claiming.commit()
        assert _row(dsn) == (None, False)  # in flight: committed without its response
        assert store.complete(other, claim, Response(201, body=b"x")) is True
        other.commit()
    assert _row(dsn) == (201, True)
