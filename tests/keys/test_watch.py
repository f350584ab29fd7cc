"""The async batches' wait for answers: one registration per connection, kept between batches.

store/wire.py waits through a duplicate of the connection's descriptor that stays registered with
the event loop. These tests hold it to what that promises, on asyncio's own loop and on uvloop
(conftest.py runs them on both; uvloop closes a registration whose socket reports an error):
a connection that dies never leaves a batch waiting forever, an idle connection that nobody
reads never keeps the loop busy, and a closed connection leaves no descriptor behind.
"""

from __future__ import annotations

import asyncio
import gc
import os
import weakref
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, Response, Won, fingerprint
from pgonce.errors import DatabaseUnavailable
from pgonce.store import wire

FP = fingerprint("watched")


def _registered(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether the connection's watch is registered with the running loop (and unregister it)."""
    watch = wire._sessions[conn.pgconn].watch
    assert watch is not None
    return asyncio.get_running_loop().remove_reader(watch.fd)


async def _terminate(dsn: str, conn: psycopg.AsyncConnection[Any]) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as killer:
        await killer.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))


async def _until_closed_by_server(conn: psycopg.AsyncConnection[Any]) -> None:
    """Until the server's goodbye (its error and the end of the stream) reached the socket."""
    readable = asyncio.Event()
    loop = asyncio.get_running_loop()
    fd = os.dup(conn.pgconn.socket)
    loop.add_reader(fd, readable.set)
    try:
        await asyncio.wait_for(readable.wait(), 10)
    finally:
        loop.remove_reader(fd)
        os.close(fd)


async def test_a_backend_terminated_mid_transaction_is_a_typed_error(
    dsn: str, astore: AsyncKeyStore
) -> None:
    # The HTTP middleware's case: the claim's batch, then the endpoint's statements through
    # psycopg, then the backend dies, then the completion's batch. On uvloop a registration kept
    # across the error used to wait forever.
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        claim = await astore.begin(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        await conn.execute("SELECT 1")
        await _terminate(dsn, conn)
        await _until_closed_by_server(conn)
        with pytest.raises(DatabaseUnavailable, match="terminating connection"):
            await asyncio.wait_for(astore.commit(conn, claim, Response(201)), 30)


async def test_an_idle_connection_closed_by_the_server_is_let_go(
    dsn: str, astore: AsyncKeyStore
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with astore.once(conn, "s", "k", FP, commit=True) as op:
            op.respond(Response(201))
        await _terminate(dsn, conn)
        await _until_closed_by_server(conn)
        for _ in range(wire._TOLERATED + 2):  # the loop's iterations that see it readable
            await asyncio.sleep(0)
        # Nobody reads the connection now: a registration still standing would wake the loop on
        # every iteration (the socket stays readable).
        assert not _registered(conn)
        with pytest.raises(DatabaseUnavailable):
            await asyncio.wait_for(astore.begin(conn, "s", "k2", FP), 30)


async def test_the_watch_survives_psycopgs_own_statements(dsn: str, astore: AsyncKeyStore) -> None:
    # psycopg registers and removes the original descriptor for its statements; the batches
    # around them keep working, and the connection ends idle and usable.
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        for number in range(20):
            async with astore.once(conn, "s", f"k{number}", FP, commit=True) as op:
                cur = await conn.execute("SELECT %s::int", (number,))
                assert await cur.fetchone() == (number,)
                op.respond(Response(201))
            assert op.stored
        cur = await conn.execute("SELECT count(*) FROM pgonce.keys WHERE scope = 's'")
        assert await cur.fetchone() == (20,)


async def test_the_loop_is_asked_once_for_the_watch(
    dsn: str, astore: AsyncKeyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # asyncio's selector loop keeps a registration until it is removed; uvloop keeps it until a
    # socket error closes it, and the watch knows when (it follows the callback's handle): either
    # way the watch registers once, not at every wait (which made a handle and cancelled one
    # each time).
    loop = asyncio.get_running_loop()
    asked: list[int] = []
    add_reader = loop.add_reader

    def counting(fd: Any, callback: Any, *args: Any) -> None:
        asked.append(fd)
        add_reader(fd, callback, *args)

    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        with monkeypatch.context() as patched:
            patched.setattr(loop, "add_reader", counting)
            for number in range(5):
                async with astore.once(conn, "once", f"k{number}", FP, commit=True) as op:
                    await conn.execute("SELECT 1")  # psycopg's own wait, on the original fd
                    op.respond(Response(201))
        watch = wire._sessions[conn.pgconn].watch
        assert watch is not None
        # Once, and again only where psycopg's read took more than one readiness report (its
        # answer in two segments): never at every batch, nor after every psycopg statement.
        assert asked.count(watch.fd) < 5


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc/self/fd (Linux)")
async def test_closed_connections_leave_no_descriptor_behind(
    dsn: str, astore: AsyncKeyStore
) -> None:
    async def use_one(number: int) -> None:
        async with (
            await psycopg.AsyncConnection.connect(dsn) as conn,
            astore.once(conn, "fd", f"k{number}", FP, commit=True) as op,
        ):
            op.execute("SELECT %s::int", (number,))  # adapted by psycopg, batched by pgonce
            op.respond(Response(201))

    async def collected() -> int:
        gc.collect()
        for _ in range(3):  # the finalizers hand the closing to the loop
            await asyncio.sleep(0)
        return _open_descriptors()

    await use_one(0)  # what the first connection opens for good (the loop's own, caches)
    before = await collected()
    for number in range(1, 11):
        await use_one(number)
    assert await collected() == before


async def test_pgonce_keeps_no_connection_alive(dsn: str, astore: AsyncKeyStore) -> None:
    # What pgonce keeps per connection (prepared names, the watch) is weakly keyed by it: nothing
    # in it may refer back to the connection, or neither would ever be collected.
    conn = await psycopg.AsyncConnection.connect(dsn)
    async with astore.once(conn, "s", "k", FP, commit=True) as op:
        op.execute("SELECT %s::int", (1,))
        op.respond(Response(201))
    gone = weakref.ref(conn)
    await conn.close()
    del conn, op
    gc.collect()
    assert gone() is None
