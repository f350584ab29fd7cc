"""A replay through once() answers what the stored row holds, and each block starts apart.

The replay's decoding reuses the claim time for the completion time when the row holds the same
instant in both (begin() and once() keep the time a claim was born completed with): a row
completed at another time must still answer that time. An operation starts with its state read
from its class: the writes it queues are its own all the same, and once() refuses what claim()
refuses.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce import AsyncKeyStore, Replay, Response, UsageError, fingerprint

FP = fingerprint("replay path")
RESPONSE = Response(201, (("content-type", "text/plain"),), b"made")


async def _replays(conn: psycopg.AsyncConnection[Any], store: AsyncKeyStore) -> list[Replay]:
    """Two replays of key "k": the first meets its headers, the second finds them known."""
    replays = []
    for _ in range(2):
        async with store.once(conn, "s", "k", FP, commit=True) as op:
            assert op.replayed
            assert op.response == RESPONSE
            assert isinstance(op.claim, Replay)
            replays.append(op.claim)
    return replays


async def test_a_replay_answers_a_completion_time_apart_from_the_claim_time(
    dsn: str, astore: AsyncKeyStore
) -> None:
    claimed = datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=UTC)
    completed = claimed + timedelta(seconds=7, microseconds=1)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        claim = await astore.begin(conn, "s", "k", FP, now=claimed)
        assert await astore.commit(conn, claim, RESPONSE, now=completed)
        for replay in await _replays(conn, astore):
            assert replay.claimed_at == claimed
            assert replay.completed_at == completed


async def test_a_replay_answers_the_times_the_row_holds(dsn: str, astore: AsyncKeyStore) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        async with astore.once(conn, "s", "k", FP, commit=True) as op:
            op.respond(RESPONSE)
        cur = await conn.execute(
            "SELECT claimed_at, completed_at FROM pgonce.keys WHERE scope = 's' AND key = 'k'"
        )
        stored = await cur.fetchone()
        await conn.rollback()
        assert stored is not None
        for replay in await _replays(conn, astore):
            assert (replay.claimed_at, replay.completed_at) == stored


async def test_the_writes_an_operation_queues_are_its_own(dsn: str, astore: AsyncKeyStore) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("CREATE TABLE probe_writes (k text NOT NULL)")
        first = astore.once(conn, "s", "a", FP, commit=True)
        second = astore.once(conn, "s", "b", FP, commit=True)
        for op in (first, second):
            assert op.response is None
            assert not op.stored
            assert (op.won, op.replayed, op.in_flight) == (False, False, False)
            with pytest.raises(UsageError):
                op.claim  # noqa: B018
        async with first as op:
            op.execute("INSERT INTO probe_writes (k) VALUES (%s)", ("a",))
            op.respond(RESPONSE)
        async with second as op:
            op.respond(RESPONSE)
        assert (first.stored, second.stored) == (True, True)
        assert first.response is RESPONSE
        cur = await conn.execute("SELECT k FROM probe_writes")
        assert await cur.fetchall() == [("a",)]


@pytest.mark.parametrize(
    ("scope", "key", "fp", "wait"),
    [
        ("", "k", FP, None),
        ("s", "", FP, None),
        ("s\x00", "k", FP, None),
        ("s", "k\x00", FP, None),
        (1, "k", FP, None),
        ("s", b"k", FP, None),
        ("s" * 513, "k", FP, None),
        ("s", "k" * 513, FP, None),
        ("s", "k", b"short", None),
        ("s", "k", bytearray(FP), None),
        ("s", "k", FP, 5),
    ],
    ids=[
        "empty scope",
        "empty key",
        "NUL in scope",
        "NUL in key",
        "int scope",
        "bytes key",
        "long scope",
        "long key",
        "short fingerprint",
        "bytearray fingerprint",
        "int wait",
    ],
)
async def test_once_refuses_what_claim_refuses(
    dsn: str, astore: AsyncKeyStore, scope: Any, key: Any, fp: Any, wait: Any
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        with pytest.raises(UsageError) as by_claim:
            await astore.claim(conn, scope, key, fp, wait=wait)
        await conn.rollback()
        with pytest.raises(UsageError) as by_once:
            astore.once(conn, scope, key, fp, commit=True, wait=wait)
        assert str(by_once.value) == str(by_claim.value)


async def test_once_refuses_what_is_not_an_async_connection(astore: AsyncKeyStore) -> None:
    with pytest.raises(UsageError) as by_claim:
        await astore.claim(object(), "s", "k", FP)  # type: ignore[arg-type]
    with pytest.raises(UsageError) as by_once:
        astore.once(object(), "s", "k", FP)  # type: ignore[arg-type]
    assert str(by_once.value) == str(by_claim.value)
