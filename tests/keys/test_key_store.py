"""The key store's contract, on real PostgreSQL, through the sync and the async API."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce import (
    AsyncKeyStore,
    InFlight,
    KeyMismatch,
    KeyStore,
    NotInTransaction,
    Replay,
    Response,
    UsageError,
    Won,
    fingerprint,
)
from tests.keys.helpers import wait_until_blocked

FP = fingerprint("POST", "/orders", b'{"amount": 42}')
BINARY = bytes(range(256)) + b"\xff\xfe not utf-8 \x00 and a NUL"
RESPONSE = Response(
    201,
    (("content-type", "application/octet-stream"), ("x-dup", "1"), ("x-dup", "2")),
    BINARY,
)


def business_write(conn: psycopg.Connection[Any], key: str) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS effects (key text, at timestamptz DEFAULT now())")
    conn.execute("INSERT INTO effects (key) VALUES (%s)", (key,))


def effects(dsn: str, key: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as c:
        exists = c.execute("SELECT to_regclass('effects') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return 0
        row = c.execute("SELECT count(*) FROM effects WHERE key = %s", (key,)).fetchone()
        return int(row[0]) if row else 0


def test_won_then_completed_then_replayed_byte_for_byte(
    conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    claim = store.claim(conn, "tenant-a", "k1", FP)
    assert isinstance(claim, Won)
    business_write(conn, "k1")
    assert store.complete(conn, claim, RESPONSE) is True
    conn.commit()

    replay = store.claim(conn, "tenant-a", "k1", FP)
    assert isinstance(replay, Replay)
    assert replay.response == RESPONSE
    assert replay.response.body == BINARY
    assert replay.completed_at >= replay.claimed_at


async def test_async_api_has_the_same_behaviour(
    aconn: psycopg.AsyncConnection[Any], astore: AsyncKeyStore
) -> None:
    claim = await astore.claim(aconn, "tenant-a", "k1", FP)
    assert isinstance(claim, Won)
    assert await astore.complete(aconn, claim, RESPONSE) is True
    await aconn.commit()
    replay = await astore.claim(aconn, "tenant-a", "k1", FP)
    assert isinstance(replay, Replay)
    assert replay.response == RESPONSE
    with pytest.raises(KeyMismatch):
        await astore.claim(aconn, "tenant-a", "k1", fingerprint("another request"))


def test_same_key_other_request_is_a_mismatch_and_changes_nothing(
    conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    claim = store.claim(conn, "s", "k", FP)
    assert isinstance(claim, Won)
    store.complete(conn, claim, RESPONSE)
    conn.commit()
    with pytest.raises(KeyMismatch, match="different request"):
        store.claim(conn, "s", "k", fingerprint("POST", "/orders", b'{"amount": 43}'))
    conn.rollback()
    replay = store.claim(conn, "s", "k", FP)
    assert isinstance(replay, Replay)
    assert replay.response == RESPONSE


def test_autocommit_connection_is_refused_and_nothing_is_written(dsn: str, store: KeyStore) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(NotInTransaction, match="autocommit"):
            store.claim(conn, "s", "k", FP)
        # Inside an explicit transaction the same connection is fine.
        with conn.transaction():
            assert isinstance(store.claim(conn, "s", "k", FP), Won)
            conn.execute("SELECT 1")
        row = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
        assert row == (1,)


def test_autocommit_refused_for_completion_too(dsn: str, store: KeyStore) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            claim = store.claim(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        with pytest.raises(NotInTransaction):
            store.complete(conn, claim, RESPONSE)


def test_second_completion_changes_nothing(conn: psycopg.Connection[Any], store: KeyStore) -> None:
    claim = store.claim(conn, "s", "k", FP)
    assert isinstance(claim, Won)
    assert store.complete(conn, claim, RESPONSE) is True
    assert store.complete(conn, claim, Response(200, (), b"other")) is False
    conn.commit()
    replay = store.claim(conn, "s", "k", FP)
    assert isinstance(replay, Replay)
    assert replay.response == RESPONSE


def test_rollback_frees_the_key_and_leaves_nothing(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    claim = store.claim(conn, "s", "k", FP)
    assert isinstance(claim, Won)
    business_write(conn, "k")
    conn.rollback()
    assert effects(dsn, "k") == 0
    again = store.claim(conn, "s", "k", FP)
    assert isinstance(again, Won)


def test_scopes_never_meet(conn: psycopg.Connection[Any], store: KeyStore) -> None:
    a = store.claim(conn, "caller-a", "same-key", FP)
    b = store.claim(conn, "caller-b", "same-key", fingerprint("something else entirely"))
    assert isinstance(a, Won)
    assert isinstance(b, Won)
    store.complete(conn, a, Response(201, (), b"a's secret order"))
    store.complete(conn, b, Response(201, (), b"b's order"))
    conn.commit()
    replay = store.claim(conn, "caller-b", "same-key", fingerprint("something else entirely"))
    assert isinstance(replay, Replay)
    assert replay.response.body == b"b's order"


def test_server_error_is_not_stored_and_frees_the_key(
    conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    claim = store.claim(conn, "s", "k", FP)
    assert isinstance(claim, Won)
    assert store.complete(conn, claim, Response(503, (), b"try later")) is False
    conn.commit()
    assert isinstance(store.claim(conn, "s", "k", FP), Won)


def test_server_error_is_stored_when_configured(conn: psycopg.Connection[Any]) -> None:
    store = KeyStore(store_server_errors=True)
    claim = store.claim(conn, "s", "k", FP)
    assert isinstance(claim, Won)
    assert store.complete(conn, claim, Response(500, (), b"boom")) is True
    conn.commit()
    replay = store.claim(conn, "s", "k", FP)
    assert isinstance(replay, Replay)
    assert replay.response.status == 500


def test_the_duplicate_path_writes_nothing(conn: psycopg.Connection[Any], store: KeyStore) -> None:
    claim = store.claim(conn, "s", "k", FP)
    assert isinstance(claim, Won)
    store.complete(conn, claim, RESPONSE)
    conn.commit()
    assert isinstance(store.claim(conn, "s", "k", FP), Replay)
    # No transaction id was assigned: no WAL, no flush, nothing written on a replay.
    assert conn.execute("SELECT pg_current_xact_id_if_assigned()").fetchone() == (None,)
    conn.rollback()


def test_a_committed_claim_without_response_is_in_flight(
    conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    assert isinstance(store.claim(conn, "s", "k", FP), Won)
    conn.commit()  # a caller that committed without completing: a stuck claim
    outcome = store.claim(conn, "s", "k", FP)
    assert outcome == InFlight(retry_after=store.retry_after, reason="incomplete")


def test_time_is_a_parameter(conn: psycopg.Connection[Any], store: KeyStore) -> None:
    then = datetime(2020, 2, 29, 12, 0, tzinfo=UTC)
    claim = store.claim(conn, "s", "k", FP, now=then)
    assert isinstance(claim, Won)
    assert claim.claimed_at == then
    store.complete(conn, claim, RESPONSE, now=then + timedelta(seconds=3))
    conn.commit()
    replay = store.claim(conn, "s", "k", FP)
    assert isinstance(replay, Replay)
    assert replay.completed_at - replay.claimed_at == timedelta(seconds=3)


def test_bad_arguments_are_usage_errors(conn: psycopg.Connection[Any], store: KeyStore) -> None:
    with pytest.raises(UsageError):
        store.claim(conn, "", "k", FP)
    with pytest.raises(UsageError):
        store.claim(conn, "s", "k", b"not a sha256")
    with pytest.raises(UsageError, match="at least 100 ms"):
        KeyStore(wait=timedelta(milliseconds=5))
    with pytest.raises(UsageError, match="at least 100 ms"):
        store.claim(conn, "s", "k", FP, wait=timedelta(milliseconds=1))


class TestRace:
    """Two real connections on one key, the second arriving while the first is still open."""

    def test_duplicate_gets_in_flight_within_the_bound_and_stays_usable(
        self, dsn: str, store: KeyStore
    ) -> None:
        with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
            assert isinstance(store.claim(first, "s", "k", FP), Won)
            outcome = store.claim(second, "s", "k", FP, wait=timedelta(milliseconds=100))
            assert outcome == InFlight(retry_after=store.retry_after, reason="locked")
            # The duplicate's transaction is still usable, and its lock_timeout is its own again.
            assert second.execute("SHOW lock_timeout").fetchone() == ("0",)
            assert second.execute("SELECT 1").fetchone() == (1,)

    def test_duplicate_waiting_when_the_original_commits_replays_it(
        self, dsn: str, store: KeyStore
    ) -> None:
        with (
            psycopg.connect(dsn) as first,
            psycopg.connect(dsn) as second,
            psycopg.connect(dsn, autocommit=True) as observer,
            ThreadPoolExecutor(1) as pool,
        ):
            claim = store.claim(first, "s", "k", FP)
            assert isinstance(claim, Won)
            waiting = pool.submit(store.claim, second, "s", "k", FP, wait=timedelta(seconds=30))
            wait_until_blocked(observer, second.info.backend_pid)
            store.complete(first, claim, RESPONSE)
            first.commit()
            outcome = waiting.result(timeout=30)
            assert isinstance(outcome, Replay)
            assert outcome.response == RESPONSE

    def test_duplicate_waiting_when_the_original_rolls_back_wins(
        self, dsn: str, store: KeyStore
    ) -> None:
        with (
            psycopg.connect(dsn) as first,
            psycopg.connect(dsn) as second,
            psycopg.connect(dsn, autocommit=True) as observer,
            ThreadPoolExecutor(1) as pool,
        ):
            assert isinstance(store.claim(first, "s", "k", FP), Won)
            waiting = pool.submit(store.claim, second, "s", "k", FP, wait=timedelta(seconds=30))
            wait_until_blocked(observer, second.info.backend_pid)
            first.rollback()
            assert isinstance(waiting.result(timeout=30), Won)

    def test_repeatable_read_duplicate_is_in_flight_not_an_error(
        self, dsn: str, store: KeyStore
    ) -> None:
        with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
            second.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            second.execute("SELECT 1")  # take the snapshot before the original commits
            claim = store.claim(first, "s", "k", FP)
            assert isinstance(claim, Won)
            store.complete(first, claim, RESPONSE)
            first.commit()
            outcome = store.claim(second, "s", "k", FP)
            assert outcome == InFlight(retry_after=store.retry_after, reason="invisible")
            assert second.execute("SELECT 1").fetchone() == (1,)
            second.rollback()
            assert isinstance(store.claim(second, "s", "k", FP), Replay)


class TestOnce:
    """The context manager: claim on entry, complete on exit, roll back on failure.

    Most of these own their transaction (``commit=True``); tests/keys/test_joins.py holds the
    block that joins the caller's.
    """

    def test_first_run_then_replay(
        self, dsn: str, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        with store.once(conn, "s", "k", FP, commit=True) as op:
            assert op.won
            business_write(conn, "k")
            op.respond(RESPONSE)
        assert op.stored
        with store.once(conn, "s", "k", FP, commit=True) as again:
            assert again.replayed
            assert not again.won
        assert again.response == RESPONSE
        assert effects(dsn, "k") == 1

    def test_exception_rolls_back_claim_and_writes(
        self, dsn: str, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        with (
            pytest.raises(RuntimeError, match="handler died"),
            store.once(conn, "s", "k", FP, commit=True) as op,
        ):
            business_write(conn, "k")
            raise RuntimeError("handler died")
        assert op.won
        assert effects(dsn, "k") == 0
        with store.once(conn, "s", "k", FP, commit=True) as retry:
            assert retry.won

    def test_server_error_response_rolls_back_and_is_returned(
        self, dsn: str, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        with store.once(conn, "s", "k", FP, commit=True) as op:
            business_write(conn, "k")
            op.respond(Response(502, (), b"upstream failed"))
        assert op.response == Response(502, (), b"upstream failed")
        assert not op.stored
        assert effects(dsn, "k") == 0
        with store.once(conn, "s", "k", FP, commit=True) as retry:
            assert retry.won

    def test_nested_in_the_callers_transaction_as_a_savepoint(
        self, dsn: str, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        with conn.transaction():
            with pytest.raises(RuntimeError), store.once(conn, "s", "k1", FP):
                business_write(conn, "k1")
                raise RuntimeError
            with store.once(conn, "s", "k2", FP) as op:
                business_write(conn, "k2")
                op.respond(RESPONSE)
        assert effects(dsn, "k1") == 0
        assert effects(dsn, "k2") == 1

    def test_only_the_winner_may_respond(
        self, conn: psycopg.Connection[Any], store: KeyStore
    ) -> None:
        with store.once(conn, "s", "k", FP, commit=True) as op:
            op.respond(RESPONSE)
        with store.once(conn, "s", "k", FP, commit=True) as again, pytest.raises(UsageError):
            again.respond(RESPONSE)

    async def test_async_once(
        self, dsn: str, aconn: psycopg.AsyncConnection[Any], astore: AsyncKeyStore
    ) -> None:
        async with astore.once(aconn, "s", "k", FP, commit=True) as op:
            assert op.won
            op.respond(RESPONSE)
        async with astore.once(aconn, "s", "k", FP, commit=True) as again:
            assert again.replayed
        assert again.response == RESPONSE


def test_in_flight_duplicate_through_once_has_no_response(dsn: str, store: KeyStore) -> None:
    gate = threading.Event()
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        assert isinstance(store.claim(first, "s", "k", FP), Won)
        with store.once(second, "s", "k", FP, wait=timedelta(milliseconds=100)) as op:
            assert op.in_flight
            assert isinstance(op.claim, InFlight)
            gate.set()
        assert op.response is None
        assert gate.is_set()
