"""A claim of ``begin()`` whose transaction ended, and a second ``begin()`` on the same
connection, then the first claim's ``commit()``.

The completion of the first claim finds no row (the end took it, or committed it), and the
guard that tells its transaction ended read a setting that the second claim had set again in
the new transaction: the first claim's ``commit()`` answered False and COMMITted the second
claim, without its response, with whatever the new transaction wrote. The second key stayed in
flight until it expired, and its writes committed as if the first claim's work.

Now the guard names the transaction the claim was made in: the batch fails before its COMMIT,
the new transaction is rolled back whole, and the call says so.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, KeyStore, Response, fingerprint
from pgonce.core.outcomes import Won
from pgonce.errors import UsageError

FP = fingerprint(b"k")
ENDS = pytest.mark.parametrize("end", ["ROLLBACK", "COMMIT"])


@pytest.fixture
def effects(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as setup:
        setup.execute("CREATE TABLE effects (what text)")


def state(dsn: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """What another connection sees: the effects, and each key with whether it was completed."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        effects = [r[0] for r in conn.execute("SELECT what FROM effects ORDER BY what")]
        keys = conn.execute(
            "SELECT key, response_headers IS NOT NULL FROM pgonce.keys ORDER BY key"
        ).fetchall()
        return effects, keys


def expected(end: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    # A COMMIT committed the first claim with its work, in flight; nothing of the second
    # transaction (the second claim, its write) commits either way.
    if end == "ROLLBACK":
        return [], []
    return ["a"], [("a", False)]


@pytest.mark.usefixtures("effects")
@ENDS
def test_commit_of_a_claim_whose_transaction_a_second_begin_replaced(dsn: str, end: str) -> None:
    store = KeyStore()
    with psycopg.connect(dsn) as conn:
        first = store.begin(conn, "s", "a", FP)
        assert isinstance(first, Won)
        conn.execute("INSERT INTO effects VALUES ('a')")
        conn.execute(end)
        second = store.begin(conn, "s", "b", FP)
        assert isinstance(second, Won)
        conn.execute("INSERT INTO effects VALUES ('b')")
        with pytest.raises(UsageError, match="ended before commit"):
            store.commit(conn, first, Response(201))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert state(dsn) == expected(end)


@pytest.mark.usefixtures("effects")
@ENDS
def test_once_commit_true_whose_block_began_another_claim(dsn: str, end: str) -> None:
    store = KeyStore()
    with psycopg.connect(dsn) as conn:
        with (
            pytest.raises(UsageError, match="ended before commit"),
            store.once(conn, "s", "a", FP, commit=True) as op,
        ):
            conn.execute("INSERT INTO effects VALUES ('a')")
            conn.execute(end)
            assert isinstance(store.begin(conn, "s", "b", FP), Won)
            conn.execute("INSERT INTO effects VALUES ('b')")
            op.respond(Response(201))
        assert op.stored is False
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert state(dsn) == expected(end)


@pytest.mark.usefixtures("effects")
@ENDS
async def test_the_async_store_refuses_it_too(dsn: str, end: str) -> None:
    store = AsyncKeyStore()
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        first = await store.begin(conn, "s", "a", FP)
        assert isinstance(first, Won)
        await conn.execute("INSERT INTO effects VALUES ('a')")
        await conn.execute(end)
        assert isinstance(await store.begin(conn, "s", "b", FP), Won)
        await conn.execute("INSERT INTO effects VALUES ('b')")
        with pytest.raises(UsageError, match="ended before commit"):
            await store.commit(conn, first, Response(201))
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert state(dsn) == expected(end)


@pytest.mark.usefixtures("effects")
def test_a_completed_claim_still_commits_false_in_its_own_transaction(dsn: str) -> None:
    # complete() before commit() in the same transaction: the completion finds no row to
    # complete and commit() answers False, committing what the transaction did, as before.
    store = KeyStore()
    with psycopg.connect(dsn) as conn:
        claim = store.begin(conn, "s", "a", FP)
        assert isinstance(claim, Won)
        conn.execute("INSERT INTO effects VALUES ('a')")
        assert store.complete(conn, claim, Response(200)) is True
        assert store.commit(conn, claim, Response(201)) is False
    assert state(dsn) == (["a"], [("a", True)])
