"""Stored responses whose headers go beyond ASCII, on connections whose client_encoding is not
UTF-8: every way of claiming (once(), begin()/commit(), claim(), in and out of psycopg's pipeline,
sync and async) stores and replays the same headers as on a UTF-8 connection."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, KeyStore, Replay, Response, UsageError, fingerprint

FP = fingerprint("encoded")
HEADERS = (
    ("content-disposition", 'attachment; filename="café.txt"'),
    ("x-note", "Größe ½"),
)
STORED = Response(200, headers=HEADERS, body=b"caf\xc3\xa9")
ENCODINGS = ["UTF8", "LATIN1", "WIN1252"]


def _connect(dsn: str, encoding: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, options=f"-c client_encoding={encoding}")


async def _aconnect(dsn: str, encoding: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(dsn, options=f"-c client_encoding={encoding}")


def _replays(store: KeyStore, conn: psycopg.Connection[Any], key: str) -> None:
    """once() and claim() both replay ``key``'s stored response, its headers intact."""
    with store.once(conn, "s", key, FP) as op:
        assert op.replayed
        assert op.response == STORED
    replay = store.claim(conn, "s", key, FP)
    assert isinstance(replay, Replay)
    assert replay.response == STORED
    assert tuple(replay.response.headers) == HEADERS


@pytest.mark.parametrize("writer", ENCODINGS)
@pytest.mark.parametrize("reader", ENCODINGS)
def test_every_claim_replays_the_stored_headers(
    dsn: str, store: KeyStore, writer: str, reader: str
) -> None:
    with _connect(dsn, writer) as conn:
        with store.once(conn, "s", "once", FP) as op:
            op.respond(STORED)
        conn.commit()
        claim = store.begin(conn, "s", "begun", FP)
        assert not isinstance(claim, Replay)
        store.commit(conn, claim, STORED)
    with _connect(dsn, reader) as conn:
        for key in ("once", "begun"):
            _replays(store, conn, key)
            conn.rollback()
            with conn.pipeline(), conn.transaction():
                _replays(store, conn, key)
            again = store.begin(conn, "s", key, FP)
            assert isinstance(again, Replay)
            assert again.response == STORED


@pytest.mark.parametrize("reader", ["LATIN1", "WIN1252"])
async def test_async_claims_replay_the_stored_headers(
    dsn: str, astore: AsyncKeyStore, reader: str
) -> None:
    async with await _aconnect(dsn, "UTF8") as conn:
        async with astore.once(conn, "s", "k", FP) as op:
            op.respond(STORED)
        await conn.commit()
    async with await _aconnect(dsn, reader) as conn:
        replay = await astore.claim(conn, "s", "k", FP)
        assert isinstance(replay, Replay)
        assert replay.response == STORED
        await conn.rollback()
        async with conn.pipeline(), conn.transaction(), astore.once(conn, "s", "k", FP) as op:
            assert op.replayed
            assert op.response == STORED
        again = await astore.begin(conn, "s", "k", FP)
        assert isinstance(again, Replay)
        assert again.response == STORED


def test_headers_the_reader_cannot_carry_are_a_usage_error(dsn: str, store: KeyStore) -> None:
    beyond = Response(200, headers=(("x-price", "5 €"),), body=b"{}")
    with _connect(dsn, "UTF8") as conn:
        with store.once(conn, "s", "euro", FP) as op:
            op.respond(beyond)
        conn.commit()
    with _connect(dsn, "LATIN1") as conn:
        carry = "client_encoding cannot carry; connect with client_encoding UTF8"
        with pytest.raises(UsageError, match=carry), store.once(conn, "s", "euro", FP):
            pass
        conn.rollback()
        with pytest.raises(UsageError, match=carry):
            store.claim(conn, "s", "euro", FP)
        conn.rollback()
        with pytest.raises(UsageError, match=carry):
            store.begin(conn, "s", "euro", FP)
