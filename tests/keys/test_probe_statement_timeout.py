"""A claim cut by the connection's statement_timeout while it waits for a concurrent claim.

An application's ``statement_timeout`` shorter than the claim's wait (1 s against the default
2 s) ends the INSERT that waits for the original request's transaction. That duplicate is in
flight, as when the wait itself runs out: ``InFlight`` with its ``retry_after``, the connection
left idle and usable, not ``DatabaseUnavailable`` (a 503 and an alert for a client's retry).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce import (
    AsyncKeyStore,
    InFlight,
    KeyInFlight,
    KeyStore,
    Response,
    Won,
    fingerprint,
    idempotent,
)

FP = fingerprint("timed out")
WAIT = timedelta(seconds=30)
IDLE = psycopg.pq.TransactionStatus.IDLE
INTRANS = psycopg.pq.TransactionStatus.INTRANS


def _timed(dsn: str, **kwargs: Any) -> dict[str, Any]:
    return {"conninfo": dsn, "options": "-c statement_timeout=200", **kwargs}


def test_begin_and_once_answer_in_flight(dsn: str, store: KeyStore) -> None:
    with psycopg.connect(dsn) as holder:
        first = store.begin(holder, "s", "k", FP)
        assert isinstance(first, Won)
        with psycopg.connect(**_timed(dsn, autocommit=True)) as conn:
            claim = store.begin(conn, "s", "k", FP, wait=WAIT)
            assert isinstance(claim, InFlight)
            assert claim.reason == "locked"
            assert claim.retry_after == store.retry_after
            assert conn.info.transaction_status == IDLE
            with store.once(conn, "s", "k", FP, commit=True, wait=WAIT) as op:
                assert op.in_flight
            with conn.transaction():
                conn.execute("CREATE TEMP TABLE mine (id int)")
                with store.once(conn, "s", "k", FP, wait=WAIT) as op:
                    assert op.in_flight
                # The caller's transaction goes on.
                conn.execute("INSERT INTO mine VALUES (1)")
                assert conn.info.transaction_status == INTRANS
        assert store.commit(holder, first, Response(201))


async def test_async_begin_and_once_answer_in_flight(dsn: str, astore: AsyncKeyStore) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as holder:
        first = await astore.begin(holder, "s", "k", FP)
        assert isinstance(first, Won)
        async with await psycopg.AsyncConnection.connect(**_timed(dsn)) as conn:
            claim = await astore.begin(conn, "s", "k", FP, wait=WAIT)
            assert isinstance(claim, InFlight)
            assert claim.reason == "locked"
            async with astore.once(conn, "s", "k", FP, commit=True, wait=WAIT) as op:
                assert op.in_flight
            async with astore.once(conn, "s", "k", FP, wait=WAIT) as op:
                assert op.in_flight
            await conn.execute("SELECT 1")
            await conn.commit()
        assert await astore.commit(holder, first, Response(201))


@pytest.mark.parametrize("commit", [True, False])
async def test_the_decorator_raises_key_in_flight(dsn: str, commit: bool) -> None:
    @idempotent(key="order_id", scope="ship", commit=commit, wait=WAIT)
    async def ship(conn: psycopg.AsyncConnection[Any], order_id: str) -> str:
        return order_id

    async with await psycopg.AsyncConnection.connect(dsn) as holder:

        @idempotent(key="order_id", scope="ship", commit=True)
        async def hold(conn: psycopg.AsyncConnection[Any], order_id: str) -> str:
            async with await psycopg.AsyncConnection.connect(**_timed(dsn)) as other:
                with pytest.raises(KeyInFlight):
                    await ship(other, order_id)
                assert other.info.transaction_status in (IDLE, INTRANS)
            return order_id

        assert await hold(holder, "o-1") == "o-1"


async def test_once_in_psycopgs_pipeline_answers_in_flight(dsn: str, astore: AsyncKeyStore) -> None:
    # In psycopg's pipeline the claim is the claim() function under psycopg's savepoint: its
    # rollback leaves the caller's transaction as it was, and the block sees the key in flight.
    async with await psycopg.AsyncConnection.connect(dsn) as holder:
        first = await astore.begin(holder, "s", "k", FP)
        assert isinstance(first, Won)
        async with await psycopg.AsyncConnection.connect(**_timed(dsn)) as conn:
            await conn.execute("CREATE TEMP TABLE mine (id int)")
            async with conn.pipeline():
                async with astore.once(conn, "s", "k", FP, wait=WAIT) as op:
                    assert op.in_flight
                await conn.execute("INSERT INTO mine VALUES (1)")
            await conn.commit()
            cur = await conn.execute("SELECT count(*) FROM mine")
            assert await cur.fetchone() == (1,)
        assert await astore.commit(holder, first, Response(201))


def test_once_in_psycopgs_pipeline_answers_in_flight_sync(dsn: str, store: KeyStore) -> None:
    with psycopg.connect(dsn) as holder:
        first = store.begin(holder, "s", "k", FP)
        assert isinstance(first, Won)
        with psycopg.connect(**_timed(dsn)) as conn:
            conn.execute("CREATE TEMP TABLE mine (id int)")
            with conn.pipeline():
                with store.once(conn, "s", "k", FP, wait=WAIT) as op:
                    assert op.in_flight
                conn.execute("INSERT INTO mine VALUES (1)")
            conn.commit()
            assert conn.execute("SELECT count(*) FROM mine").fetchone() == (1,)
        assert store.commit(holder, first, Response(201))
