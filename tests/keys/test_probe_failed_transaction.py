"""claim(), complete() and release() on a connection whose transaction has failed.

A statement before the call raised (and was caught), so PostgreSQL ignores everything until the
transaction ends: the call was sent anyway and came back as a DatabaseError in PostgreSQL's
words, which reads as an infrastructure failure to retry. It is the caller's to roll back, as
once() and begin() already say: a UsageError at the call, before anything is sent, that says
so. Rolling back is also what frees a claim the failed transaction made.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, KeyStore, Response, UsageError, Won, fingerprint

FP = fingerprint("failed transaction")
FAILED = "transaction has failed"


def _fail(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(psycopg.errors.DivisionByZero):
        conn.execute("SELECT 1 / 0")


@pytest.mark.parametrize("call", ["claim", "complete", "release"])
def test_a_call_in_a_failed_transaction_is_refused(dsn: str, store: KeyStore, call: str) -> None:
    with psycopg.connect(dsn) as conn:
        claim = store.claim(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        _fail(conn)
        calls: dict[str, Callable[[], object]] = {
            "claim": lambda: store.claim(conn, "s", "k2", FP),
            "complete": lambda: store.complete(conn, claim, Response(201)),
            "release": lambda: store.release(conn, claim),
        }
        with pytest.raises(UsageError, match=FAILED):
            calls[call]()
        conn.rollback()
        # The rollback freed the claim: the key is won again.
        assert isinstance(store.claim(conn, "s", "k", FP), Won)


async def test_the_async_store_refuses_them_too(dsn: str, astore: AsyncKeyStore) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        claim = await astore.claim(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        with pytest.raises(psycopg.errors.DivisionByZero):
            await conn.execute("SELECT 1 / 0")
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: astore.claim(conn, "s", "k2", FP),
            lambda: astore.complete(conn, claim, Response(201)),
            lambda: astore.release(conn, claim),
        ]
        for call in calls:
            with pytest.raises(UsageError, match=FAILED):
                await call()
        await conn.rollback()
        assert isinstance(await astore.claim(conn, "s", "k", FP), Won)
