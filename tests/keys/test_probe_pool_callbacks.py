"""The key store on the connections of a psycopg_pool pool whose callbacks set the sessions up as
applications do: ``configure`` turns autocommit on and sets search_path, TimeZone and DateStyle,
``reset`` runs ``DISCARD ALL`` when a connection comes back, which drops every prepared
statement, pgonce's with psycopg's. Each checkout claims in the caller's transaction, replays,
and claims with ``commit=True``; every effect happens once, and pgonce neither fails on a name
that DISCARD ALL dropped nor takes it for a transaction-mode pooler.

With ``prepare_threshold=0`` psycopg prepares every statement at once and clears its names (and
pgonce's) when it sees the DISCARD ALL. With a threshold between 1 and 5 psycopg's own statements
fail after such a reset (26000 on ``_pg3_N``), with or without pgonce: not a case of these tests."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from pgonce import AsyncKeyStore, KeyStore, Response, fingerprint
from pgonce.store import wire

CHECKOUTS = 12
RESPONSE = Response(201, (("content-type", "text/plain"),), b"created")


#: One statement each: with prepare_threshold=0 psycopg prepares every statement, and a prepared
#: statement holds one command.
SETUP = (
    "SET search_path TO app",
    "SET TimeZone TO 'Pacific/Chatham'",
    "SET DateStyle TO 'German'",
)


def _effects(dsn: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute("SELECT k, count(*) FROM app.orders GROUP BY k ORDER BY k").fetchall()
        stored = c.execute("SELECT count(*) FROM pgonce.keys WHERE response_status = 201")
        return [*rows, ("stored", stored.fetchone()[0])]  # type: ignore[index]


def _expected() -> list[tuple[Any, ...]]:
    keys = sorted([f"j{i}" for i in range(CHECKOUTS)] + [f"o{i}" for i in range(CHECKOUTS)])
    return [*((k, 1) for k in keys), ("stored", 2 * CHECKOUTS)]


def _schema(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE SCHEMA app")
        c.execute("CREATE TABLE app.orders (k text)")


@pytest.mark.parametrize("prepare_threshold", [0, None])
def test_a_pool_that_discards_all_at_reset(
    dsn: str, prepare_threshold: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    _schema(dsn)
    store = KeyStore()

    def configure(conn: psycopg.Connection[Any]) -> None:
        conn.prepare_threshold = prepare_threshold
        conn.autocommit = True
        for statement in SETUP:
            conn.execute(statement)

    def reset(conn: psycopg.Connection[Any]) -> None:
        conn.execute("DISCARD ALL")

    caplog.set_level(logging.WARNING, logger="pgonce")
    with ConnectionPool(dsn, min_size=1, max_size=1, configure=configure, reset=reset) as pool:
        for i in range(CHECKOUTS):
            with pool.connection() as conn:
                for statement in SETUP:  # DISCARD ALL reset them
                    conn.execute(statement)
                for _ in range(2):  # the second time, a replay
                    with (
                        conn.transaction(),
                        store.once(conn, "s", f"j{i}", fingerprint(b"j")) as op,
                    ):
                        if op.won:
                            conn.execute("INSERT INTO orders VALUES (%s)", (f"j{i}",))
                            op.respond(RESPONSE)
                    assert op.response == RESPONSE
                with store.once(conn, "s", f"o{i}", fingerprint(b"o"), commit=True) as owned:
                    assert owned.won
                    owned.execute("INSERT INTO orders VALUES (%s)", (f"o{i}",))
                    owned.respond(RESPONSE)
                assert owned.stored
    assert _effects(dsn) == _expected()
    assert not wire.statements_unnamed()
    assert [r.getMessage() for r in caplog.records] == []


@pytest.mark.parametrize("prepare_threshold", [0, None])
async def test_an_async_pool_that_discards_all_at_reset(
    dsn: str, prepare_threshold: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    _schema(dsn)
    store = AsyncKeyStore()

    async def configure(conn: psycopg.AsyncConnection[Any]) -> None:
        conn.prepare_threshold = prepare_threshold
        await conn.set_autocommit(True)
        for statement in SETUP:
            await conn.execute(statement)

    async def reset(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("DISCARD ALL")

    caplog.set_level(logging.WARNING, logger="pgonce")
    async with AsyncConnectionPool(
        dsn, min_size=1, max_size=1, configure=configure, reset=reset
    ) as pool:
        for i in range(CHECKOUTS):
            async with pool.connection() as conn:
                for statement in SETUP:
                    await conn.execute(statement)
                for _ in range(2):
                    async with (
                        conn.transaction(),
                        store.once(conn, "s", f"j{i}", fingerprint(b"j")) as op,
                    ):
                        if op.won:
                            await conn.execute("INSERT INTO orders VALUES (%s)", (f"j{i}",))
                            op.respond(RESPONSE)
                    assert op.response == RESPONSE
                async with store.once(conn, "s", f"o{i}", fingerprint(b"o"), commit=True) as owned:
                    assert owned.won
                    owned.execute("INSERT INTO orders VALUES (%s)", (f"o{i}",))
                    owned.respond(RESPONSE)
                assert owned.stored
    assert _effects(dsn) == _expected()
    assert not wire.statements_unnamed()
    assert [r.getMessage() for r in caplog.records] == []
