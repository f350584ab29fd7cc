"""once() (and so ``@idempotent``) on a connection inside a COPY block (``cur.copy()``).

psycopg holds the connection's lock for the whole block, and once() saw a statement under way
(ACTIVE, outside the pipeline) and went for psycopg's savepoint, which waits for that lock: for
ever from inside the block, as long as the block from another thread. It is a
:class:`~pgonce.UsageError` at once, and the COPY goes on.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, KeyStore, UsageError, fingerprint, idempotent

FP = fingerprint("copied")
BUSY = "running a statement: a COPY block"


@pytest.mark.parametrize("autocommit", [False, True], ids=["transaction", "autocommit"])
async def test_once_inside_a_copy_block_is_refused_at_once(
    dsn: str, astore: AsyncKeyStore, autocommit: bool
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit) as conn:
        cur = conn.cursor()
        async with cur.copy("COPY (SELECT generate_series(1, 3)) TO STDOUT") as copy:
            with pytest.raises(UsageError, match=BUSY):
                await asyncio.wait_for(astore.once(conn, "s", "k", FP).__aenter__(), 10)
            rows = [row async for row in copy.rows()]
        assert rows == [("1",), ("2",), ("3",)]


def test_a_decorated_call_from_another_thread_during_a_copy_is_refused(
    dsn: str, store: KeyStore
) -> None:
    @idempotent(key="k", scope="copied", store=store)
    def ship(conn: psycopg.Connection[Any], k: str) -> str:
        return k

    raised: list[BaseException] = []

    def call(conn: psycopg.Connection[Any]) -> None:
        try:
            ship(conn, "k-1")
        except BaseException as error:
            raised.append(error)

    with psycopg.connect(dsn) as conn:
        with conn.cursor().copy("COPY (SELECT 1) TO STDOUT") as copy:
            other = threading.Thread(target=call, args=(conn,), daemon=True)
            other.start()
            other.join(10)
            assert not other.is_alive(), "the call waited for the COPY's lock"
            assert list(copy.rows()) == [("1",)]
        assert len(raised) == 1
        assert isinstance(raised[0], UsageError)
        assert BUSY in str(raised[0])
        conn.commit()
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)
