"""Mistakes that used to pass the call and fail later, far from it: at the completion, after the
work ran, or as psycopg's error (or a wrong diagnosis) from inside the store.

Each is now refused at the call with a :class:`~pgonce.errors.UsageError` that names it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from pgonce.core.fingerprint import fingerprint
from pgonce.core.outcomes import Response
from pgonce.errors import UsageError
from pgonce.store._async.keys import AsyncKeyStore
from pgonce.store._sync.keys import KeyStore

FP = fingerprint("POST", "/orders", b"{}")
NAIVE = datetime(2026, 1, 1, 12, 0)  # naive: the mistake under test


def _stored(conn: psycopg.Connection[Any], key: str) -> int:
    conn.rollback()
    row = conn.execute("SELECT count(*) FROM pgonce.keys WHERE key = %s", (key,)).fetchone()
    conn.rollback()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    ("now", "message"),
    [
        ("2026-01-01", "now must be a datetime, not str"),
        (1767268800, "now must be a datetime, not int"),
        (NAIVE, "timezone-aware"),
    ],
)
def test_a_now_that_is_not_an_aware_datetime_is_refused_at_the_claim(
    conn: psycopg.Connection[Any], now: Any, message: str
) -> None:
    # It was psycopg's AttributeError from begin() and once(), a "run `pgonce migrate`"
    # SchemaNotMigrated from claim() given an int, and a naive datetime was read in the server's
    # TimeZone, whatever the caller meant.
    store = KeyStore()
    with pytest.raises(UsageError, match=message):
        store.begin(conn, "s", "k-begin", FP, now=now)
    with pytest.raises(UsageError, match=message), conn.transaction():
        store.claim(conn, "s", "k-claim", FP, now=now)
    with pytest.raises(UsageError, match=message), store.once(conn, "s", "k-once", FP, now=now):
        pass
    with (
        pytest.raises(UsageError, match=message),
        store.once(conn, "s", "k-owned", FP, commit=True, now=now),
    ):
        pass
    for key in ("k-begin", "k-claim", "k-once", "k-owned"):
        assert _stored(conn, key) == 0


def test_a_now_that_is_not_an_aware_datetime_is_refused_at_the_completion(
    conn: psycopg.Connection[Any],
) -> None:
    store = KeyStore()
    won = store.begin(conn, "s", "k-commit", FP)
    with pytest.raises(UsageError, match="timezone-aware"):
        store.commit(conn, won, Response(200), now=NAIVE)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _stored(conn, "k-commit") == 0
    with conn.transaction():
        claimed = store.claim(conn, "s", "k-complete", FP)
        with pytest.raises(UsageError, match="now must be a datetime, not str"):
            store.complete(conn, claimed, Response(200), now="2026-01-01")  # type: ignore[arg-type]


def test_an_aware_now_is_still_taken(conn: psycopg.Connection[Any]) -> None:
    store = KeyStore()
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    won = store.begin(conn, "s", "k-aware", FP, now=now)
    assert store.commit(conn, won, Response(200), now=now)


@pytest.mark.parametrize(
    "headers",
    [[("x-note", "a\x00b")], [("x-\x00", "b")], {"x-note": "\x00"}, (["x-note", "é\x00"],)],
)
def test_a_nul_in_a_header_is_refused_at_construction(headers: Any) -> None:
    # PostgreSQL's jsonb cannot hold U+0000: the completion failed with "unsupported Unicode
    # escape sequence" after the work had run, and rolled it back.
    with pytest.raises(UsageError, match="NUL"):
        Response(200, headers)


def test_a_nul_header_never_reaches_the_completion(conn: psycopg.Connection[Any]) -> None:
    store = KeyStore()
    with store.once(conn, "s", "k-nul", FP) as op:
        with pytest.raises(UsageError, match="NUL"):
            op.respond(Response(200, (("x-note", "a\x00b"),)))
        op.respond(Response(200, (("x-note", "ab"),)))
    conn.commit()
    assert op.stored


def _failed(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(psycopg.errors.DivisionByZero):
        conn.execute("SELECT 1/0")


@pytest.mark.parametrize("block", [False, True], ids=["transaction", "transaction-block"])
def test_once_in_a_failed_transaction_is_refused_with_the_fix(
    conn: psycopg.Connection[Any], block: bool
) -> None:
    # It was psycopg's InFailedSqlTransaction from the savepoint, raised from pgonce's internals.
    store = KeyStore()
    refused: list[BaseException] = []

    def attempt() -> None:
        _failed(conn)
        try:
            with store.once(conn, "s", "k-failed", FP):
                raise AssertionError("the block ran")
        except Exception as error:
            refused.append(error)

    if block:
        with pytest.raises(psycopg.errors.InFailedSqlTransaction), conn.transaction():
            attempt()
            conn.execute("SELECT 1")  # still failed: once() changed nothing
    else:
        attempt()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
    assert len(refused) == 1
    assert type(refused[0]) is UsageError, repr(refused[0])
    assert "has failed" in str(refused[0])
    assert "roll it back" in str(refused[0])
    conn.rollback()
    assert _stored(conn, "k-failed") == 0


async def test_async_once_in_a_failed_transaction_is_refused_with_the_fix(
    aconn: psycopg.AsyncConnection[Any],
) -> None:
    store = AsyncKeyStore()
    with pytest.raises(psycopg.errors.DivisionByZero):
        await aconn.execute("SELECT 1/0")
    with pytest.raises(UsageError, match=r"has failed.*roll"):
        async with store.once(aconn, "s", "k-afailed", FP):
            raise AssertionError("the block ran")
    await aconn.rollback()


def test_the_happy_path_beside_these_checks_is_unchanged(conn: psycopg.Connection[Any]) -> None:
    store = KeyStore()
    won = store.begin(conn, "s", "k-plain", FP)
    assert store.commit(conn, won, Response(201, (("x-a", "b"),), b"ok"))


@pytest.mark.parametrize("status", [2**31, -(2**31) - 1, 10**20])
def test_a_status_the_column_cannot_hold_is_refused_at_construction(status: int) -> None:
    # response_status is an integer column: with store_server_errors the completion failed
    # with "out of range" after the work ran; without, the status counted as a 5xx and the
    # work was rolled back, answered only by commit()'s False.
    with pytest.raises(UsageError, match="status"):
        Response(status)


def test_an_out_of_range_status_never_reaches_the_completion(
    conn: psycopg.Connection[Any],
) -> None:
    store = KeyStore(store_server_errors=True)
    won = store.begin(conn, "s", "k-range", FP)
    with pytest.raises(UsageError, match="status"):
        store.commit(conn, won, Response(2**31))
    conn.rollback()
    assert _stored(conn, "k-range") == 0


@pytest.mark.parametrize(
    ("writes", "given"),
    [
        (["INSERT INTO pgonce_written VALUES (1)"], "a str"),
        ([("INSERT INTO pgonce_written VALUES (1)",)], "a tuple of 1"),
        (("INSERT INTO pgonce_written VALUES (%s)", (1,)), "a str"),  # one pair, not a list of them
        ("INSERT INTO pgonce_written VALUES (1)", "a str"),
        (None, "NoneType"),
    ],
)
def test_writes_that_are_not_query_and_params_pairs_are_named(
    conn: psycopg.Connection[Any], writes: Any, given: str
) -> None:
    # They were Python's ValueError or TypeError from the unpacking inside commit(), with
    # nothing to say which argument, or how it should look.
    conn.execute("CREATE TABLE IF NOT EXISTS pgonce_written (x int)")
    conn.commit()
    store = KeyStore()
    won = store.begin(conn, "s", "k-writes", FP)
    with pytest.raises(UsageError, match=rf"writes must be .*\(query, params\).*{given}"):
        store.commit(conn, won, Response(200), writes=writes)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _stored(conn, "k-writes") == 0


def test_a_write_psycopg_refuses_is_still_psycopg_s_error(conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS pgonce_written (x int)")
    conn.commit()
    store = KeyStore()
    won = store.begin(conn, "s", "k-write-params", FP)
    with pytest.raises(TypeError, match="sequence or a mapping"):
        store.commit(
            conn,
            won,
            Response(200),
            writes=[("INSERT INTO pgonce_written VALUES (%s)", 1)],  # type: ignore[list-item]
        )
