"""``committed()``: whether a claim committed, asked after the caller's code ended the claim's
transaction itself. The answer comes from the claim's completion in a transaction rolled back at
once: nothing is stored, and a committed claim stays in flight."""

from __future__ import annotations

import psycopg
import pytest

from pgonce import AsyncKeyStore, KeyStore, fingerprint
from pgonce.core.outcomes import Won

FP = fingerprint(b"k")


def stored(dsn: str) -> list[bool]:
    """For each key, whether a response is stored, as another connection sees it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT response_headers IS NOT NULL FROM pgonce.keys")]


@pytest.mark.parametrize("end", ["ROLLBACK", "COMMIT"])
def test_committed_tells_an_ended_claim_apart_and_stores_nothing(dsn: str, end: str) -> None:
    store = KeyStore()
    with psycopg.connect(dsn) as conn:
        claim = store.begin(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        conn.execute(end)
        assert store.committed(conn, claim) is (end == "COMMIT")
        # Asked again: the probe stored nothing, so the answer is the same.
        assert store.committed(conn, claim) is (end == "COMMIT")
    assert stored(dsn) == ([False] if end == "COMMIT" else [])


@pytest.mark.parametrize("end", ["ROLLBACK", "COMMIT"])
async def test_the_async_store_answers_the_same(dsn: str, end: str) -> None:
    store = AsyncKeyStore()
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        claim = await store.begin(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        await conn.execute(end)
        assert await store.committed(conn, claim) is (end == "COMMIT")
    assert stored(dsn) == ([False] if end == "COMMIT" else [])
