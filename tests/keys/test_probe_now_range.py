"""A clock (``now=``) whose instant in UTC is outside what a datetime can hold.

Year 1 at +14:00 is in year 0 in UTC, year 9999 at -14:00 in year 10000: PostgreSQL stores either,
but the claim's time read back cannot be a datetime. The claim was made and left in the caller's
transaction, with an ``OverflowError`` (or a DatabaseError from psycopg's loader) as the only word
of it: committed, the key stayed in flight for ever. Refused at the call, before anything is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, KeyStore, Response, UsageError, Won, fingerprint

FP = fingerprint("clock")
CLOCKS = [
    datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14))),
    datetime(9999, 12, 31, 23, 59, tzinfo=timezone(timedelta(hours=-14))),
]
IDS = ["before-year-1", "after-year-9999"]


def _once(store: KeyStore, conn: psycopg.Connection[Any], now: datetime) -> None:
    with store.once(conn, "s", "k", FP, now=now) as op:
        op.respond(Response(200))


def _piped(store: KeyStore, conn: psycopg.Connection[Any], now: datetime) -> None:
    with conn.pipeline(), store.once(conn, "s", "k", FP, now=now) as op:
        op.respond(Response(200))


def _owned(store: KeyStore, conn: psycopg.Connection[Any], now: datetime) -> None:
    with store.once(conn, "s", "k", FP, now=now, commit=True) as op:
        op.respond(Response(200))


def _claim(store: KeyStore, conn: psycopg.Connection[Any], now: datetime) -> None:
    store.claim(conn, "s", "k", FP, now=now)


def _begin(store: KeyStore, conn: psycopg.Connection[Any], now: datetime) -> None:
    store.begin(conn, "s", "k", FP, now=now)


CALLS: list[Callable[[KeyStore, psycopg.Connection[Any], datetime], None]] = [
    _once,
    _piped,
    _owned,
    _claim,
    _begin,
]


@pytest.mark.parametrize("now", CLOCKS, ids=IDS)
@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__.strip("_"))
def test_a_clock_outside_datetime_in_utc_is_refused_with_nothing_claimed(
    dsn: str,
    store: KeyStore,
    call: Callable[[KeyStore, psycopg.Connection[Any], datetime], None],
    now: datetime,
) -> None:
    with psycopg.connect(dsn) as conn:
        with pytest.raises(UsageError, match="now must be an instant that datetime can hold"):
            call(store, conn, now)
        conn.commit()  # whatever the call left in the transaction commits
        row = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    assert row == (0,)


@pytest.mark.parametrize("now", CLOCKS, ids=IDS)
def test_a_completion_with_such_a_clock_is_refused(
    dsn: str, store: KeyStore, now: datetime
) -> None:
    with psycopg.connect(dsn) as conn:
        claim = store.claim(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        with pytest.raises(UsageError, match="now must be an instant that datetime can hold"):
            store.complete(conn, claim, Response(200), now=now)


@pytest.mark.parametrize("now", CLOCKS, ids=IDS)
async def test_the_async_store_refuses_it_too(
    dsn: str, astore: AsyncKeyStore, now: datetime
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        with pytest.raises(UsageError, match="now must be an instant that datetime can hold"):
            async with astore.once(conn, "s", "k", FP, now=now) as op:
                op.respond(Response(200))
        await conn.commit()
        cur = await conn.execute("SELECT count(*) FROM pgonce.keys")
        assert await cur.fetchone() == (0,)
