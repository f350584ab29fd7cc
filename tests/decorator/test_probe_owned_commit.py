"""A ``commit=True`` decorated function that commits or rolls back the call's transaction itself.

psycopg refuses it (the transaction is counted as a ``conn.transaction()`` block), with a
message about a "Transaction context" the function cannot see; the call says what it means
instead, a :class:`UsageError` with psycopg's error as its cause, and nothing commits: not the
function's writes, not the claim.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pgonce import UsageError, idempotent


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE shipments (order_id text NOT NULL)")
        yield conn


def counts(db: psycopg.Connection[Any]) -> tuple[int, int]:
    row = db.execute(
        "SELECT (SELECT count(*) FROM shipments), (SELECT count(*) FROM pgonce.keys)"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@pytest.mark.parametrize("end", ["commit", "rollback"])
@pytest.mark.parametrize("autocommit", [False, True], ids=["transactional", "autocommit"])
def test_a_commit_or_rollback_inside_an_owned_call_is_a_usage_error(
    dsn: str, db: psycopg.Connection[Any], end: str, autocommit: bool
) -> None:
    @idempotent(key="order_id", scope=f"ship-{end}", commit=True)
    def ship(conn: psycopg.Connection[Any], order_id: str) -> str:
        conn.execute("INSERT INTO shipments VALUES (%s)", (order_id,))
        getattr(conn, end)()
        return order_id

    with psycopg.connect(dsn, autocommit=autocommit) as conn:
        with pytest.raises(UsageError, match=r"called conn.commit\(\) or conn.rollback\(\)") as e:
            ship(conn, "o-1")
        assert isinstance(e.value.__cause__, psycopg.ProgrammingError)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert counts(db) == (0, 0)  # nothing committed: the key is free


async def test_a_commit_inside_an_owned_coroutine_is_a_usage_error(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    @idempotent(key="order_id", scope="ship-async", commit=True)
    async def ship(conn: psycopg.AsyncConnection[Any], order_id: str) -> str:
        await conn.execute("INSERT INTO shipments VALUES (%s)", (order_id,))
        await conn.commit()
        return order_id

    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        with pytest.raises(UsageError, match=r"called conn.commit\(\) or conn.rollback\(\)"):
            await ship(conn, "o-1")
    assert counts(db) == (0, 0)


def test_another_programming_error_of_the_function_is_its_own(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    @idempotent(key="order_id", scope="ship-typo", commit=True)
    def ship(conn: psycopg.Connection[Any], order_id: str) -> str:
        conn.execute("INSERT INTO shipments VALUES (%s, %s)", (order_id,))  # one too few
        return order_id

    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.ProgrammingError):
        ship(conn, "o-1")
    assert counts(db) == (0, 0)
