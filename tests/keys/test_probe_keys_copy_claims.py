"""claim(), complete(), release(), begin() and commit() on a connection inside a COPY block
(``cur.copy()``), as once() is (tests/keys/test_probe_copy_block.py).

psycopg holds the connection's lock for the whole block: claim() went for it through its cursor
and waited for ever from inside the block (for as long as the block from another thread). Each is
a :class:`~pgonce.UsageError` at the call, and the COPY goes on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, KeyStore, UsageError, Won, fingerprint

FP = fingerprint("copied")
BUSY = "running a statement: a COPY block"
COPY = "COPY (SELECT generate_series(1, 3)) TO STDOUT"
ROWS = [("1",), ("2",), ("3",)]


def _won(store: KeyStore, dsn: str, key: str) -> Won:
    with psycopg.connect(dsn) as conn:
        claim = store.claim(conn, "s", key, FP)
        assert isinstance(claim, Won)
        return claim


@pytest.mark.parametrize("autocommit", [False, True], ids=["transaction", "autocommit"])
@pytest.mark.parametrize("call", ["claim", "complete", "release", "begin", "commit"])
async def test_a_store_call_inside_a_copy_block_is_refused_at_once(
    dsn: str, astore: AsyncKeyStore, store: KeyStore, autocommit: bool, call: str
) -> None:
    won = _won(store, dsn, "k")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit) as conn:
        calls: dict[str, Callable[[], Any]] = {
            "claim": lambda: astore.claim(conn, "s", "k2", FP),
            "complete": lambda: astore.complete(conn, won),
            "release": lambda: astore.release(conn, won),
            "begin": lambda: astore.begin(conn, "s", "k2", FP),
            "commit": lambda: astore.commit(conn, won),
        }
        async with conn.transaction() if autocommit else _nothing():
            async with conn.cursor().copy(COPY) as copy:
                with pytest.raises(UsageError, match=BUSY):
                    await asyncio.wait_for(calls[call](), 5)
                rows = [row async for row in copy.rows()]
            assert rows == ROWS
            assert await (await conn.execute("SELECT 1")).fetchall() == [(1,)]


class _nothing:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("call", ["claim", "complete", "release", "begin", "commit"])
def test_a_store_call_from_another_thread_during_a_copy_is_refused(
    dsn: str, store: KeyStore, call: str
) -> None:
    won = _won(store, dsn, "k")
    raised: list[BaseException] = []
    with psycopg.connect(dsn) as conn:
        calls: dict[str, Callable[[], Any]] = {
            "claim": lambda: store.claim(conn, "s", "k2", FP),
            "complete": lambda: store.complete(conn, won),
            "release": lambda: store.release(conn, won),
            "begin": lambda: store.begin(conn, "s", "k2", FP),
            "commit": lambda: store.commit(conn, won),
        }

        def run() -> None:
            try:
                calls[call]()
            except BaseException as error:
                raised.append(error)

        with conn.cursor().copy(COPY) as copy:
            other = threading.Thread(target=run, daemon=True)
            other.start()
            other.join(5)
            alive = other.is_alive()
            assert list(copy.rows()) == ROWS
        other.join(10)
        assert not alive, f"{call}() waited for the COPY's lock"
        assert len(raised) == 1
        assert isinstance(raised[0], UsageError)
        assert BUSY in str(raised[0])
        conn.rollback()
