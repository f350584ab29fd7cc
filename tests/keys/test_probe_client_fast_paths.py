"""The key store's shortcuts on its hot path answer what its general path answers.

A replay whose stored headers were met before is decoded without the general row and decision:
a mismatch, an incomplete claim and headers a Response does not hold as stored must still go
through every check. The BEGIN is read from psycopg's own attributes only where the connection
class reads its settings through psycopg's own properties: a subclass's override is honoured.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, KeyMismatch, KeyStore, Replay, Response, fingerprint

FP = fingerprint("fast")
OTHER = fingerprint("other")


async def _stored(conn: psycopg.AsyncConnection[Any], store: AsyncKeyStore, key: str) -> None:
    async with store.once(conn, "s", key, FP, commit=True) as op:
        op.respond(Response(201, (("content-type", "text/plain"),), b"made"))


async def test_a_replay_of_known_headers_is_the_stored_response(
    dsn: str, astore: AsyncKeyStore
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await _stored(conn, astore, "k")
        replays = []
        for _ in range(3):  # the first decodes the headers, the next ones find them known
            async with astore.once(conn, "s", "k", FP, commit=True) as op:
                assert op.replayed
                replays.append(op.claim)
        for claim in replays:
            assert isinstance(claim, Replay)
            assert claim.response == Response(201, (("content-type", "text/plain"),), b"made")
            assert claim.completed_at >= claim.claimed_at
        assert replays[1] == replays[2]


async def test_a_mismatch_is_raised_when_the_headers_are_known(
    dsn: str, astore: AsyncKeyStore
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await _stored(conn, astore, "k")
        async with astore.once(conn, "s", "k", FP, commit=True) as op:
            assert op.replayed
        with pytest.raises(KeyMismatch):
            async with astore.once(conn, "s", "k", OTHER, commit=True):
                pass
        assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE


async def test_a_claim_committed_without_its_response_is_in_flight(
    dsn: str, astore: AsyncKeyStore
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await _stored(conn, astore, "k")
        async with astore.once(conn, "s", "k", FP, commit=True) as op:
            assert op.replayed
        await conn.set_autocommit(True)
        await conn.execute(
            "INSERT INTO pgonce.keys (scope, key, fingerprint, claimed_at, response_headers)"
            " VALUES ('s', 'half', %s, now(), '[[\"content-type\",\"text/plain\"]]')",
            (FP,),
        )
        async with astore.once(conn, "s", "half", FP, commit=True) as op:
            assert op.in_flight
            assert op.claim.reason == "incomplete"  # type: ignore[union-attr]


async def test_headers_not_held_as_stored_come_back_as_they_were(
    dsn: str, astore: AsyncKeyStore
) -> None:
    headers = (("x-name", "caf\u00e9"),)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with astore.once(conn, "s", "k", FP, commit=True) as op:
            op.respond(Response(None, headers, b""))
        for _ in range(2):
            async with astore.once(conn, "s", "k", FP, commit=True) as op:
                assert op.replayed
                assert op.response == Response(None, headers, b"")


class _ReadOnly(psycopg.Connection[Any]):
    """A connection class whose transactions are read-only by its own property."""

    @property
    def read_only(self) -> bool | None:
        return True

    @read_only.setter
    def read_only(self, value: bool | None) -> None:
        raise AttributeError("read-only, always")


def test_a_subclass_that_overrides_a_setting_is_honoured(dsn: str, store: KeyStore) -> None:
    with _ReadOnly.connect(dsn) as conn:
        # begin() sends the BEGIN the class's property asks for: the claim cannot write there.
        with pytest.raises(Exception, match="read-only transaction"):
            store.begin(conn, "s", "k", FP)
        assert conn.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
    with psycopg.connect(dsn) as plain:
        assert plain.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)
        plain.rollback()
        assert store.begin(plain, "s", "k", FP).kind == "won"
        plain.rollback()
