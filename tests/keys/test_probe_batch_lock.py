"""An async batch holds the connection's lock (psycopg's asyncio.Lock) for its round trip.

store/wire.py takes and gives back a free lock that nobody waits for without the lock's own
coroutine; these tests hold it to the lock's rules all the same, on asyncio's loop and on uvloop:
a batch waits for a lock held elsewhere, a task that waits for the lock behind a batch gets it
when the batch ends, a batch that fails or is cancelled gives the lock back, and giving back a
lock that someone else released still fails as asyncio.Lock.release() does.
"""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from pgonce.store import wire

SELECT_ONE = (wire.Statement(b"SELECT 1", prepare=False), wire.NO_PARAMS)
SLEEP = (wire.Statement(b"SELECT pg_sleep(0.3)", prepare=False), wire.NO_PARAMS)
FAILING = (wire.Statement(b"SELECT 1/0", prepare=False), wire.NO_PARAMS)


async def test_a_batch_waits_for_the_lock_held_elsewhere(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        order: list[str] = []
        await conn.lock.acquire()
        batch = asyncio.create_task(wire.async_round_trip(conn, [SELECT_ONE]))
        await asyncio.sleep(0.2)
        assert not batch.done()  # still waiting for the lock
        order.append("released")
        conn.lock.release()
        results = await asyncio.wait_for(batch, 10)
        order.append("batch")
        assert order == ["released", "batch"]
        assert results[0].get_value(0, 0) is not None
        assert not conn.lock.locked()


async def test_a_task_waiting_behind_a_batch_gets_the_lock(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        order: list[str] = []

        async def batch() -> None:
            await wire.async_round_trip(conn, [SLEEP])
            order.append("batch")

        async def waiter() -> None:
            async with conn.lock:
                order.append("waiter")

        running = asyncio.create_task(batch())
        await asyncio.sleep(0.1)  # the batch holds the lock, waiting for its answer
        assert conn.lock.locked()
        waiting = asyncio.create_task(waiter())
        await asyncio.wait_for(asyncio.gather(running, waiting), 10)
        assert order == ["batch", "waiter"]
        assert not conn.lock.locked()
        cur = await conn.execute("SELECT 2")  # psycopg's own statements go on
        assert await cur.fetchone() == (2,)


async def test_a_failed_batch_gives_the_lock_back(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        results = await wire.async_round_trip(conn, [FAILING])
        failed = wire.failure(conn, results)
        assert failed is not None
        assert isinstance(failed[1], psycopg.errors.DivisionByZero)
        assert not conn.lock.locked()
        assert (await wire.async_round_trip(conn, [SELECT_ONE]))[0].ntuples == 1


async def test_a_cancelled_batch_gives_the_lock_back(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        batch = asyncio.create_task(wire.async_round_trip(conn, [SLEEP]))
        await asyncio.sleep(0.1)
        batch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await batch
        assert not conn.lock.locked()
        assert conn.closed  # results left unread: the connection cannot go on


async def test_a_lock_released_by_someone_else_fails_as_asyncio_says(dsn: str) -> None:
    # The batch's end gives the lock back as release() would: a lock no longer held raises.
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        batch = asyncio.create_task(wire.async_round_trip(conn, [SLEEP]))
        await asyncio.sleep(0.1)
        conn.lock.release()  # a misuse: the batch's lock, released by another task
        with pytest.raises(RuntimeError, match="Lock is not acquired"):
            await asyncio.wait_for(batch, 10)
