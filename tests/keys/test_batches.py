"""begin() and commit(): pgonce's statements in batches on psycopg's libpq connection.

A batch talks to libpq directly, so what psycopg normally guarantees is proven here: the
connection comes back in the state psycopg expects, prepared statements survive (or recover from)
DEALLOCATE ALL, transaction settings are honoured, an interrupted round trip never leaves results
behind for the next user, and the wire is what the docstrings say (two round trips).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq
from psycopg.pq import TransactionStatus

from pgonce import AsyncKeyStore, InFlight, KeyStore, Replay, Response, UsageError, Won, fingerprint
from pgonce.errors import ConfigError, DatabaseError, DatabaseUnavailable
from pgonce.store import wire
from pgonce.store.common import complete_claimed
from tests.keys.helpers import wait_until_blocked
from tests.keys.test_key_store import effects

FP = fingerprint("batched")
BODY = bytes(range(256))


def _idle_and_usable(conn: psycopg.Connection[Any]) -> None:
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert conn.pgconn.pipeline_status == pq.PipelineStatus.OFF
    assert conn.execute("SELECT 1").fetchone() == (1,)
    conn.rollback()


def test_begin_then_commit_stores_and_replays_byte_for_byte(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    claim = store.begin(conn, "s", "k", FP)
    assert isinstance(claim, Won)
    assert conn.info.transaction_status == TransactionStatus.INTRANS
    conn.execute("CREATE TABLE effects (key text)")
    conn.execute("INSERT INTO effects VALUES ('k')")
    response = Response(201, (("content-type", "application/octet-stream"),), BODY)
    assert store.commit(conn, claim, response) is True
    _idle_and_usable(conn)
    replay = store.begin(conn, "s", "k", FP)
    assert isinstance(replay, Replay)
    assert replay.response == response
    assert replay.claimed_at.tzinfo is not None
    # A duplicate wrote nothing: begin() ended its transaction with the read of the stored row.
    assert conn.pgconn.transaction_status == TransactionStatus.IDLE
    assert store.commit(conn, replay) is False
    assert effects(dsn, "k") == 1
    _idle_and_usable(conn)


def test_explicit_time_round_trips(conn: psycopg.Connection[Any], store: KeyStore) -> None:
    at = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    claim = store.begin(conn, "s", "k", FP, now=at)
    assert isinstance(claim, Won)
    store.commit(conn, claim, Response(200), now=at + timedelta(seconds=1))
    replay = store.begin(conn, "s", "k", FP)
    assert isinstance(replay, Replay)
    assert replay.claimed_at == at
    store.commit(conn, replay)


def test_server_error_not_stored_rolls_back_everything(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    conn.execute("CREATE TABLE effects (key text)")
    conn.commit()
    claim = store.begin(conn, "s", "k", FP)
    conn.execute("INSERT INTO effects VALUES ('k')")
    assert store.commit(conn, claim, Response(503)) is False
    assert effects(dsn, "k") == 0
    assert isinstance(store.begin(conn, "s", "k", FP), Won)
    conn.rollback()


def test_the_completion_is_a_hot_update(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    # A begin() claim is born with completed_at, so its completion changes no column an index
    # reads: PostgreSQL updates the row in place (HOT), without new index entries.
    for n in range(10):
        claim = store.begin(conn, "s", f"k{n}", FP)
        store.commit(conn, claim, Response(201, (("content-type", "text/plain"),), b"done"))
    conn.execute("SELECT pg_stat_force_next_flush()")  # this backend's counts, now
    conn.commit()
    with psycopg.connect(dsn) as other:
        counts = other.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables"
            " WHERE relid = 'pgonce.keys'::regclass"
        ).fetchone()
    assert counts == (10, 10)


def test_the_completion_reaches_the_row_by_the_address_its_insert_returned(
    conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    # commit() updates begin()'s row by its ctid (claim.row), with the scope and key as a guard.
    others = []
    for n in range(3):
        other = store.begin(conn, "s", f"n{n}", FP)
        assert isinstance(other, Won)
        assert other.row is not None
        store.commit(conn, other, Response(201, body=f"n{n}".encode()))
        others.append(other)
    claim = store.begin(conn, "s", "k", FP)
    assert isinstance(claim, Won)
    assert claim.row is not None
    # The plan every later execution of the prepared statement reuses: one heap fetch by the
    # address, no index descent.
    conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
    block, line = int.from_bytes(claim.row[:4], "big"), int.from_bytes(claim.row[4:], "big")
    params = {"scope": "s", "key": "k", "status": 201, "headers": None, "body": None}
    plan = conn.execute(
        b"EXPLAIN " + complete_claimed("pgonce"),
        {**params, "now": None, "row": f"({block},{line})"},
    ).fetchall()
    assert "Tid Scan" in plan[1][0], plan
    # Pointed at another key's row, the completion changes nothing: the guard holds.
    wrong = replace(claim, row=others[0].row)
    assert store.commit(conn, wrong, Response(201, body=b"k")) is False
    replay = store.begin(conn, "s", "n0", FP)
    assert isinstance(replay, Replay)
    assert replay.response.body == b"n0"
    assert isinstance(store.begin(conn, "s", "k", FP), InFlight)  # committed with no response


@pytest.mark.parametrize("first", ["complete", "release"])
def test_commit_after_the_row_changed_in_the_transaction_changes_nothing(
    conn: psycopg.Connection[Any], store: KeyStore, first: str
) -> None:
    # The address begin() returned names a version this transaction has since replaced or
    # deleted: commit()'s completion finds nothing, like a second completion by key.
    claim = store.begin(conn, "s", "k", FP)
    assert isinstance(claim, Won)
    if first == "complete":
        assert store.complete(conn, claim, Response(201, body=b"first")) is True
    else:
        store.release(conn, claim)
    assert store.commit(conn, claim, Response(201, body=b"second")) is False
    _idle_and_usable(conn)
    again = store.begin(conn, "s", "k", FP)
    if first == "complete":
        assert isinstance(again, Replay)
        assert again.response.body == b"first"
    else:
        assert isinstance(again, Won)  # released: the key is free
        conn.rollback()


def test_a_begin_claim_committed_by_hand_stays_in_flight(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    # A misuse: the caller commits begin()'s transaction itself, without the response. The row
    # has its completed_at, but no response: retries are told to wait, never replayed nothing.
    assert isinstance(store.begin(conn, "s", "k", FP), Won)
    conn.commit()
    retry = store.begin(conn, "s", "k", FP)
    assert retry == InFlight(retry_after=store.retry_after, reason="incomplete")
    store.commit(conn, retry)
    with psycopg.connect(dsn) as other:
        inside = store.claim(other, "s", "k", FP)
    assert inside == InFlight(retry_after=store.retry_after, reason="incomplete")


@pytest.mark.parametrize("taken", ["claim_insert", "claim_read"])
def test_a_name_taken_behind_pgonce_back_switches_to_unnamed_statements(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore, taken: str
) -> None:
    # A name taken on the server session (42P05) is what a transaction-mode pooler shows: another
    # client prepared it there. The failed preparation must never be read as an answer (its
    # statement was skipped: "did not win", then a missing row); begin() rolls back, the process
    # sends pgonce's statements unnamed from then on, and the claim runs again from BEGIN.
    with psycopg.connect(dsn) as other:
        won = store.begin(other, "s", "done", FP)
        store.commit(other, won, Response(201))
    name = getattr(store, f"_{taken}").name.decode()
    conn.execute(f'PREPARE "{name}" AS SELECT 1')
    conn.commit()
    assert not wire.statements_unnamed()
    claim = store.begin(conn, "s", "new" if taken == "claim_insert" else "done", FP)
    assert wire.statements_unnamed()
    if taken == "claim_insert":
        assert isinstance(claim, Won)
        store.commit(conn, claim, Response(201))
    else:
        assert isinstance(claim, Replay)
        assert claim.response.status == 201
    _idle_and_usable(conn)
    assert conn.execute("SELECT count(*) FROM pgonce.keys WHERE key = 'new'").fetchone() == (
        1 if taken == "claim_insert" else 0,
    )
    # The statement under pgonce's name is still the other one: pgonce never ran it.
    row = conn.execute(
        "SELECT statement FROM pg_prepared_statements WHERE name = %s", (name,)
    ).fetchone()
    assert row is not None
    assert "SELECT 1" in row[0]


def test_a_statement_vanishing_twice_on_one_connection_switches_to_unnamed(
    conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    # Once is DEALLOCATE ALL (prepare again); twice on the same connection is a pooler handing
    # the connection another server session each transaction.
    for round_ in range(2):
        with store.once(conn, "s", f"a{round_}", FP) as op:
            op.respond(Response(201))
        conn.execute("DEALLOCATE ALL")
        conn.commit()
        assert wire.statements_unnamed() is False
        with store.once(conn, "s", f"b{round_}", FP) as op:
            assert op.won
            op.respond(Response(201))
        assert wire.statements_unnamed() is (round_ == 1)
    row = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
    assert row == (0,)  # after the second DEALLOCATE ALL nothing was prepared again


def test_the_pooler_setting_refuses_a_connection_that_prepares(dsn: str) -> None:
    pooled = KeyStore(pooler="pgbouncer-transaction")
    with psycopg.connect(dsn) as conn, pytest.raises(UsageError, match="prepare_threshold=None"):
        pooled.begin(conn, "s", "k", FP)
    with pytest.raises(ConfigError, match="pooler 'pgbouncer' is not known"):
        KeyStore(pooler="pgbouncer")


def test_begin_refuses_a_connection_in_a_transaction_or_pipeline(
    conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    conn.execute("SELECT 1")
    with pytest.raises(UsageError, match="idle connection"):
        store.begin(conn, "s", "k", FP)
    conn.rollback()
    with conn.pipeline(), pytest.raises(UsageError, match="pipeline"):
        store.begin(conn, "s", "k", FP)


def test_deallocate_all_behind_pgonce_back_is_recovered(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    for key in ("a", "b"):
        with store.once(conn, "s", key, FP, commit=True) as op:
            op.respond(Response(201))
    conn.execute("DEALLOCATE ALL")  # what a pool's reset (DISCARD ALL) also does
    conn.commit()
    with store.once(conn, "s", "c", FP, commit=True) as op:
        assert op.won
        op.respond(Response(201))
    assert op.stored
    with store.once(conn, "s", "c", FP, commit=True) as again:
        assert again.replayed


@pytest.mark.parametrize("pooler", ["auto", "pgbouncer-transaction"])
def test_without_prepared_statements(dsn: str, pooler: str) -> None:
    # prepare_threshold=None is how psycopg runs behind a transaction-mode pooler: pgonce must
    # not leave named statements behind either, told so by the setting or not.
    store = KeyStore(pooler=pooler)
    with psycopg.connect(dsn, prepare_threshold=None) as conn:
        for _ in range(3):
            with store.once(conn, "s", "k", FP, commit=True) as op:
                if op.won:
                    op.respond(Response(201))
        assert op.replayed
        row = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
        assert row == (0,)


def test_told_there_is_no_pooler_it_prepares_whatever_the_connection_says(dsn: str) -> None:
    # Django turns psycopg's preparing off on every connection, pooler or not: pooler="none"
    # is how a caller that knows better keeps the server from planning each claim again.
    store = KeyStore(pooler="none")
    with psycopg.connect(dsn, prepare_threshold=None) as conn:
        for key in ("a", "b", "a"):
            with store.once(conn, "s", key, FP, commit=True) as op:
                if op.won:
                    op.respond(Response(201))
        assert len(_prepared_statements(conn)) == 5


def test_prepared_once_per_connection(conn: psycopg.Connection[Any], store: KeyStore) -> None:
    for key in ("a", "b", "c", "a", "b"):
        with store.once(conn, "s", key, FP, commit=True) as op:
            if op.won:
                op.respond(Response(201))
    names = conn.execute(
        "SELECT name FROM pg_prepared_statements WHERE name LIKE '_pgonce_%' ORDER BY name"
    ).fetchall()
    conn.rollback()
    # BEGIN, the claim's INSERT, the read of a duplicate, the completion and COMMIT
    assert len(names) == 5


def _pgonce_statements(conn: psycopg.Connection[Any]) -> list[str]:
    """pgonce's statements that the connection's server session holds prepared."""
    rows = conn.execute(
        "SELECT statement FROM pg_prepared_statements WHERE name LIKE '_pgonce_%'"
    ).fetchall()
    return [statement for (statement,) in rows]


def _prepared_statements(conn: psycopg.Connection[Any]) -> list[str]:
    """:func:`_pgonce_statements`, the transaction of the query ended."""
    statements = _pgonce_statements(conn)
    conn.rollback()
    return statements


def test_a_statement_twice_in_one_batch_is_prepared_once(
    conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    conn.execute("CREATE TABLE effects (key text, n int)")
    conn.commit()
    with store.once(conn, "s", "k", FP, commit=True) as op:
        for n in (1, 2, 3):
            op.execute("INSERT INTO effects (key, n) VALUES (%s, %s)", ("k", n))
        op.respond(Response(201))
    assert op.stored
    assert conn.execute("SELECT n FROM effects ORDER BY n").fetchall() == [(1,), (2,), (3,)]
    conn.rollback()
    inserts = [s for s in _prepared_statements(conn) if s.startswith("INSERT INTO effects")]
    assert len(inserts) == 1


def test_past_the_cap_statements_run_unnamed(
    conn: psycopg.Connection[Any], store: KeyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn.execute("CREATE TABLE effects (key text, n int)")
    conn.commit()
    with store.once(conn, "s", "first", FP, commit=True) as op:
        op.respond(Response(201))
    held = len(_prepared_statements(conn))
    # Room for one more: the first new statement is prepared, the next ones are sent unnamed.
    monkeypatch.setattr(wire, "MAX_PREPARED", held + 1)
    with store.once(conn, "s", "second", FP, commit=True) as op:
        op.execute("INSERT INTO effects (key, n) VALUES (%s, 1)", ("a",))
        op.execute("INSERT INTO effects (key, n) VALUES (%s, 2)", ("b",))
        op.execute("INSERT INTO effects (key, n) VALUES (%s, 3)", ("c",))
        op.execute("INSERT INTO effects (key, n) VALUES (%s, 1)", ("d",))
        op.respond(Response(201))
    assert op.stored
    rows = conn.execute("SELECT key, n FROM effects ORDER BY key").fetchall()
    conn.rollback()
    assert rows == [("a", 1), ("b", 2), ("c", 3), ("d", 1)]
    assert len(_prepared_statements(conn)) == held + 1


def test_transaction_settings_are_honoured(dsn: str, store: KeyStore) -> None:
    with psycopg.connect(dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        claim = store.begin(conn, "s", "k", FP)
        level = conn.execute("SHOW transaction_isolation").fetchone()
        assert level == ("serializable",)
        store.commit(conn, claim, Response(201))
        conn.read_only = True
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            # The claim writes: a read-only transaction refuses it, and pgonce says so.
            try:
                store.begin(conn, "s", "other", FP)
            except Exception as error:
                raise error.__cause__ or error from None
        assert conn.info.transaction_status == TransactionStatus.IDLE


def test_in_flight_leaves_lock_timeout_as_it_was(dsn: str, store: KeyStore) -> None:
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        second.execute("SET lock_timeout = '7s'")
        second.commit()
        assert isinstance(store.begin(first, "s", "k", FP), Won)
        duplicate = store.begin(second, "s", "k", FP, wait=timedelta(milliseconds=100))
        assert isinstance(duplicate, InFlight)
        assert second.execute("SHOW lock_timeout").fetchone() == ("7s",)
        store.commit(second, duplicate)
        first.rollback()


def test_won_claim_gives_the_transaction_back_its_own_lock_timeout(
    dsn: str, store: KeyStore
) -> None:
    # The claim bounds its own wait with lock_timeout; the caller's statements after it, in the
    # same transaction, run with the caller's value.
    with psycopg.connect(dsn) as conn:
        conn.execute("SET lock_timeout = '7s'")
        conn.commit()
        claim = store.begin(conn, "s", "k", FP, wait=timedelta(milliseconds=100))
        assert isinstance(claim, Won)
        assert conn.execute("SHOW lock_timeout").fetchone() == ("7s",)
        store.commit(conn, claim, Response(201))


def test_claim_whose_wait_ran_out_leaves_the_connection_ready_to_claim_again(
    dsn: str, store: KeyStore
) -> None:
    # The wait's timeout aborts the claim's batch halfway: statements after the INSERT were
    # neither run nor prepared, and the next claim on this connection must not count on them.
    with psycopg.connect(dsn) as first, psycopg.connect(dsn) as second:
        original = store.begin(first, "s", "k", FP)
        assert isinstance(original, Won)
        duplicate = store.begin(second, "s", "k", FP, wait=timedelta(milliseconds=100))
        assert duplicate == InFlight(retry_after=store.retry_after, reason="locked")
        assert second.info.transaction_status == TransactionStatus.IDLE
        assert store.commit(second, duplicate) is False
        store.commit(first, original, Response(201, body=b"done"))
        replay = store.begin(second, "s", "k", FP)
        assert isinstance(replay, Replay)
        assert replay.response.body == b"done"
        store.commit(second, replay)
        _idle_and_usable(second)


def test_killed_connection_mid_round_trip(dsn: str, store: KeyStore) -> None:
    with (
        psycopg.connect(dsn) as first,
        psycopg.connect(dsn) as second,
        psycopg.connect(dsn, autocommit=True) as killer,
    ):
        assert isinstance(store.begin(first, "s", "k", FP), Won)

        def kill_when_blocked() -> None:
            wait_until_blocked(killer, second.info.backend_pid)
            killer.execute("SELECT pg_terminate_backend(%s)", (second.info.backend_pid,))

        thread = threading.Thread(target=kill_when_blocked)
        thread.start()
        with pytest.raises(Exception, match="claiming a key failed"):
            store.begin(second, "s", "k", FP, wait=timedelta(seconds=30))
        thread.join()
        assert second.closed or second.info.status == pq.ConnStatus.BAD
        first.rollback()


async def test_cancelled_task_mid_round_trip_closes_the_connection(
    dsn: str, astore: AsyncKeyStore
) -> None:
    # A task cancelled while its batch waits for the server cannot leave the results unread for
    # the next user of the connection: the connection is closed, and the server rolls back.
    async with _duplicate_waiting(dsn, astore) as (second, task):
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert second.closed
    async with (
        await psycopg.AsyncConnection.connect(dsn) as conn,
        astore.once(conn, "s", "k", FP, commit=True) as op,
    ):
        assert op.won


def _syncs_and_named_parses(trace: Path) -> tuple[int, list[list[str]]]:
    """From libpq's trace: how many round trips the client ended (one Sync each), and the
    statements it prepared under a name."""
    sent = [line.split("\t") for line in trace.read_text().splitlines()]
    syncs = [fields for fields in sent if fields[0] == "F" and fields[2] == "Sync"]
    named = [f for f in sent if f[0] == "F" and f[2] == "Parse" and not f[3].startswith(' ""')]
    return len(syncs), named


def test_two_round_trips_on_the_wire(dsn: str, store: KeyStore, tmp_path: Path) -> None:
    # libpq's own protocol trace: each round trip ends with one Sync from the client. A fresh
    # key is BEGIN + claim, then completion + COMMIT (the block's insert is its own statement);
    # a duplicate is BEGIN + claim, then the stored row + COMMIT.
    trace = tmp_path / "trace"
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE effects (key text)")
        conn.commit()
        for _ in range(2):  # a fresh key, then its duplicate: every statement prepared once
            with store.once(conn, "s", "warm", FP, commit=True) as op:
                if op.won:
                    op.respond(Response(201))
        with trace.open("w") as out:
            conn.pgconn.trace(out.fileno())
            conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
            with store.once(conn, "s", "k", FP, commit=True) as op:
                op.respond(Response(201))
            with store.once(conn, "s", "k", FP, commit=True) as replay:
                assert replay.replayed
            conn.pgconn.untrace()
    syncs, named = _syncs_and_named_parses(trace)
    assert op.stored
    assert syncs == 4  # fresh: 2 round trips; duplicate: 2 round trips
    assert named == []  # pgonce's statements were prepared once, on the warm-up


def test_queued_writes_commit_with_the_response_in_two_round_trips(
    dsn: str, store: KeyStore, tmp_path: Path
) -> None:
    trace = tmp_path / "trace"
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE effects (key text PRIMARY KEY, amount int, at date)")
        conn.commit()
        with trace.open("w") as out:
            conn.pgconn.trace(out.fileno())
            conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
            with store.once(conn, "s", "k", FP, commit=True) as op:
                op.execute(
                    "INSERT INTO effects (key, amount, at) VALUES (%s, %s, %s)",
                    ("k", 42, datetime(2026, 11, 29).date()),
                )
                op.execute("UPDATE effects SET amount = amount + %(more)s", {"more": 1})
                op.respond(Response(201, (), b"created"))
            conn.pgconn.untrace()
        assert op.stored
        row = conn.execute("SELECT key, amount, at::text FROM effects").fetchone()
        assert row == ("k", 43, "2026-11-29")
        conn.rollback()
    syncs = [line for line in trace.read_text().splitlines() if line.startswith("F\t4\tSync")]
    assert len(syncs) == 2


@pytest.mark.parametrize("owned", [True, False])
def test_failing_queued_write_rolls_back_and_raises_psycopgs_error(
    dsn: str, store: KeyStore, owned: bool
) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE effects (key text PRIMARY KEY)")
        conn.execute("INSERT INTO effects VALUES ('taken')")
        conn.commit()
        if not owned:
            conn.execute("SELECT 1")  # the block runs inside the caller's transaction
        with (
            pytest.raises(psycopg.errors.UniqueViolation),
            store.once(conn, "s", "k", FP, commit=owned) as op,
        ):
            op.execute("INSERT INTO effects VALUES (%s)", ("k",))
            op.execute("INSERT INTO effects VALUES (%s)", ("taken",))
            op.respond(Response(201))
        conn.rollback()
        _idle_and_usable(conn)
    assert effects(dsn, "k") == 0
    with psycopg.connect(dsn) as conn, store.once(conn, "s", "k", FP, commit=True) as retry:
        assert retry.won


def test_queued_writes_are_discarded_with_an_unstored_response(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    conn.execute("CREATE TABLE effects (key text)")
    conn.commit()
    with store.once(conn, "s", "k", FP, commit=True) as op:
        op.execute("INSERT INTO effects VALUES (%s)", ("k",))
        op.respond(Response(500))
    assert not op.stored
    assert effects(dsn, "k") == 0


def test_only_the_winner_queues_writes(conn: psycopg.Connection[Any], store: KeyStore) -> None:
    with store.once(conn, "s", "k", FP, commit=True) as op:
        op.respond(Response(201))
    with (
        store.once(conn, "s", "k", FP, commit=True) as again,
        pytest.raises(UsageError, match="won"),
    ):
        again.execute("INSERT INTO nowhere VALUES (1)")


async def test_async_queued_writes(dsn: str, astore: AsyncKeyStore) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute("CREATE TABLE effects (key text PRIMARY KEY)")
        await conn.commit()
        for _ in range(2):
            async with astore.once(conn, "s", "k", FP, commit=True) as op:
                if op.won:
                    op.execute("INSERT INTO effects VALUES (%s)", ("k",))
                    op.respond(Response(201, (), b"ok"))
        assert op.replayed
        assert op.response == Response(201, (), b"ok")
    assert effects(dsn, "k") == 1


async def test_connection_lost_mid_round_trip_is_a_typed_error(
    dsn: str, astore: AsyncKeyStore
) -> None:
    # The socket dies while the batch waits for its answers (as when PostgreSQL restarts in
    # immediate mode): a DatabaseUnavailable, never a stray exception from half-read results.
    async with _duplicate_waiting(dsn, astore) as (second, task):
        with socket.socket(fileno=os.dup(second.pgconn.socket)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        with pytest.raises(DatabaseUnavailable):
            await task
        assert second.closed


@contextlib.asynccontextmanager
async def _duplicate_waiting(
    dsn: str, astore: AsyncKeyStore
) -> AsyncIterator[tuple[psycopg.AsyncConnection[Any], asyncio.Task[Any]]]:
    """A second connection's begin() of a key the first holds, blocked on the first's row lock."""
    async with (
        await psycopg.AsyncConnection.connect(dsn) as first,
        await psycopg.AsyncConnection.connect(dsn) as second,
    ):
        assert isinstance(await astore.begin(first, "s", "k", FP), Won)
        task = asyncio.create_task(astore.begin(second, "s", "k", FP, wait=timedelta(seconds=30)))
        await _until_waiting_on_a_lock(dsn, second.info.backend_pid)
        yield second, task
        await first.rollback()


async def _until_waiting_on_a_lock(dsn: str, pid: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as watcher:
        for _ in range(2000):
            cur = await watcher.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            )
            row = await cur.fetchone()
            if row and row[0] == "Lock":
                return
            await asyncio.sleep(0.005)
    raise AssertionError(f"backend {pid} never waited on a lock")


@pytest.mark.parametrize(
    ("query", "params"),
    [
        ("INSERT INTO t VALUES (%s, %s)", (1, "a")),
        ("INSERT INTO t VALUES (%s, %s)", ("a", None)),  # the same text, other types
        ("INSERT INTO t VALUES (%s, %s)", (2**40, b"\x00")),
        (b"INSERT INTO t VALUES (%s, %b)", (1.5, b"raw")),
        ("UPDATE t SET a = %(a)s WHERE b = %(b)s OR c = %(a)s", {"a": 1, "b": "x"}),
        ("SELECT '100%%', %s", (datetime(2026, 12, 2, tzinfo=UTC),)),
        ("SELECT %s" + " " * 5000, ("long",)),  # longer than psycopg caches
        (psycopg.sql.SQL("SELECT {}, %s").format(psycopg.sql.Identifier("c")), (1,)),
        ("SELECT 1", None),
    ],
)
def test_a_queued_write_is_sent_as_psycopg_would_send_it(
    conn: psycopg.Connection[Any], query: Any, params: Any
) -> None:
    # Each call converts anew what psycopg converts anew (the parameters); what is kept between
    # calls (the query's $n form) must never carry one call's types or formats into another.
    from psycopg._queries import PostgresQuery
    from psycopg.adapt import Transformer

    for _ in range(2):
        statement, sent = wire.caller_command(conn, query, params)
        expected = PostgresQuery(Transformer.from_context(conn))
        expected.convert(query, params)
        assert statement.sql == expected.query
        assert statement.types == expected.types
        assert statement.formats == tuple(expected.formats or ())
        assert list(sent) == list(expected.params or ())


@pytest.mark.parametrize("params", [(1,), (1, 2, 3), {"a": 1}, 7])
def test_a_queued_write_with_the_wrong_parameters_fails_as_psycopg_does(
    conn: psycopg.Connection[Any], params: Any
) -> None:
    query = "INSERT INTO t VALUES (%s, %s)"
    wire.caller_command(conn, query, (1, 2))  # converted and kept
    with pytest.raises(Exception) as theirs:
        conn.execute(query, params)
    conn.rollback()
    with pytest.raises(type(theirs.value)) as ours:
        wire.caller_command(conn, query, params)
    if isinstance(theirs.value, psycopg.ProgrammingError):
        assert str(ours.value) == str(theirs.value)
    # Parameters that are no sequence nor mapping: a TypeError from either (psycopg's own
    # conversion stumbles on len() before its check; pgonce's reaches the check).


@pytest.mark.parametrize("opened", [True, False], ids=["in a transaction", "idle"])
def test_once_in_the_callers_transaction_takes_two_round_trips(
    dsn: str, store: KeyStore, tmp_path: Path, opened: bool
) -> None:
    # The savepoint travels with the claim (and BEGIN, when no transaction is open yet), and
    # ends with the completion: RELEASE; or, for a duplicate, with the stored row's read:
    # ROLLBACK TO and RELEASE. The savepoint's statements are never prepared.
    trace = tmp_path / "trace"
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE effects (key text)")
        conn.commit()
        for _ in range(2):  # a fresh key, then its duplicate: every statement prepared once
            with store.once(conn, "s", "warm", FP) as op:
                if op.won:
                    op.execute("INSERT INTO effects VALUES ('k')")
                    op.respond(Response(201))
            conn.commit()
        conn.execute("DELETE FROM effects")
        conn.commit()
        if opened:
            conn.execute("INSERT INTO effects VALUES ('before')")
        with trace.open("w") as out:
            conn.pgconn.trace(out.fileno())
            conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
            with store.once(conn, "s", "k", FP) as op:
                op.execute("INSERT INTO effects VALUES ('k')")
                op.respond(Response(201))
            with store.once(conn, "s", "k", FP) as replay:
                assert replay.replayed
            conn.pgconn.untrace()
        assert conn.info.transaction_status == TransactionStatus.INTRANS
        conn.commit()
    syncs, named = _syncs_and_named_parses(trace)
    assert op.stored
    assert syncs == 4  # fresh: 2 round trips; duplicate: 2 round trips
    assert named == []
    assert effects(dsn, "k") == 1
    assert effects(dsn, "before") == (1 if opened else 0)


def test_once_in_the_callers_transaction_leaves_its_settings_and_writes_as_they_were(
    dsn: str, store: KeyStore
) -> None:
    # Won, in flight (the wait ran out) or replayed: the caller's lock_timeout is its own after
    # the block, and what the transaction wrote before it is still there.
    with psycopg.connect(dsn) as conn, psycopg.connect(dsn) as other:
        conn.execute("CREATE TABLE effects (key text)")
        conn.execute("SET lock_timeout = '7s'")
        conn.commit()
        conn.execute("INSERT INTO effects VALUES ('before')")
        with store.once(conn, "s", "won", FP, wait=timedelta(milliseconds=100)) as op:
            assert op.won
            assert conn.execute("SHOW lock_timeout").fetchone() == ("7s",)
            op.respond(Response(201))
        assert conn.execute("SHOW lock_timeout").fetchone() == ("7s",)
        assert isinstance(store.claim(other, "s", "taken", FP), Won)
        with store.once(conn, "s", "taken", FP, wait=timedelta(milliseconds=100)) as busy:
            assert busy.in_flight
        assert conn.execute("SHOW lock_timeout").fetchone() == ("7s",)
        with store.once(conn, "s", "won", FP) as replay:
            assert replay.replayed
        assert conn.execute("SHOW lock_timeout").fetchone() == ("7s",)
        assert conn.execute("SELECT count(*) FROM effects").fetchone() == (1,)
        conn.commit()
        other.rollback()
    assert effects(dsn, "before") == 1


def test_deallocate_all_inside_the_callers_transaction_keeps_its_writes(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    # The claim's prepared name is gone when once() runs: the failure comes after the
    # savepoint, which is rolled back, and the claim runs again; the caller's transaction, and
    # what it wrote before, never see the failure.
    with store.once(conn, "s", "warm", FP) as op:
        op.respond(Response(201))
    conn.execute("CREATE TABLE effects (key text)")
    conn.commit()
    conn.execute("INSERT INTO effects VALUES ('before')")
    conn.execute("DEALLOCATE ALL")
    with store.once(conn, "s", "k", FP) as op:
        assert op.won
        op.respond(Response(201))
    conn.commit()
    assert op.stored
    assert effects(dsn, "before") == 1
    with store.once(conn, "s", "k", FP) as replay:
        assert replay.replayed
    conn.rollback()


def test_a_transaction_ended_inside_the_block_is_refused(
    conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    # The commit took the claim and the block's writes with it: the caller is told at the
    # block's end, and the response is stored in a transaction of pgonce's own, so that a retry
    # replays it instead of being told "in flight" until the key expires.
    with pytest.raises(UsageError, match="ended inside its block"), store.once(conn, "s", "k", FP):
        conn.commit()
    with store.once(conn, "s", "k", FP, wait=timedelta(milliseconds=100)) as again:
        assert again.replayed
    conn.rollback()


def test_connection_killed_inside_a_joined_block_is_a_typed_error(
    dsn: str, store: KeyStore
) -> None:
    with (
        psycopg.connect(dsn) as conn,
        psycopg.connect(dsn, autocommit=True) as killer,
    ):
        conn.execute("CREATE TABLE effects (key text)")
        conn.commit()
        with pytest.raises(DatabaseUnavailable), store.once(conn, "s", "k", FP) as op:
            op.execute("INSERT INTO effects VALUES ('k')")
            killer.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
            op.respond(Response(201, (), b"lost"))
    assert effects(dsn, "k") == 0
    with psycopg.connect(dsn) as conn, store.once(conn, "s", "k", FP) as retry:
        assert retry.won


@pytest.mark.parametrize("joined", [True, False], ids=["caller's transaction", "commit=True"])
@pytest.mark.parametrize("how", ["DEALLOCATE ALL", "a rolled-back savepoint"])
def test_prepared_statements_dropped_inside_the_block_keep_the_completion(
    dsn: str, store: KeyStore, how: str, joined: bool
) -> None:
    # Between the claim and the completion the server forgets every prepared statement: by the
    # caller's own DEALLOCATE ALL, or by psycopg, which sends one after a ROLLBACK while it holds
    # prepared statements (prepare_threshold=0 here: at once). The completion must still store
    # the response, and the block's writes commit with it.
    with psycopg.connect(dsn, prepare_threshold=0, autocommit=not joined) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS effects (key text)")
        if joined:
            conn.commit()
        with store.once(conn, "s", "warm", FP, commit=not joined) as op:
            op.respond(Response(201))
        if joined:
            conn.commit()
        with store.once(conn, "s", "k", FP, commit=not joined) as op:
            assert op.won
            conn.execute("INSERT INTO effects VALUES ('k')")
            assert _pgonce_statements(conn)
            if how == "DEALLOCATE ALL":
                conn.execute("DEALLOCATE ALL")
            else:
                with contextlib.suppress(psycopg.errors.DivisionByZero), conn.transaction():
                    conn.execute("SELECT 1 / 0")
            assert _pgonce_statements(conn) == []
            op.respond(Response(201, body=b"done"))
        if joined:
            conn.commit()
        assert op.stored
        assert effects(dsn, "k") == 1


def test_a_deallocate_all_psycopg_does_not_see_fails_the_completion_loudly(dsn: str) -> None:
    # pooler="none" prepares pgonce's statements on a connection where psycopg prepares none
    # (Django's): a DEALLOCATE ALL the application sends then goes unseen (psycopg does not
    # look at a statement's status while it holds no names). The completion fails: a typed
    # error, the block's writes rolled back with it, the key free for the retry, never a
    # response stored without its writes.
    store = KeyStore(pooler="none")
    with psycopg.connect(dsn, prepare_threshold=None) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS effects (key text)")
        conn.commit()
        with store.once(conn, "s", "warm", FP, commit=True) as op:
            op.respond(Response(201))
        with (
            pytest.raises(DatabaseError, match="does not exist"),
            store.once(conn, "s", "k", FP, commit=True) as op,
        ):
            conn.execute("INSERT INTO effects VALUES ('k')")
            conn.execute("DEALLOCATE ALL")
            op.respond(Response(201, body=b"done"))
        assert not op.stored
        assert effects(dsn, "k") == 0
        with store.once(conn, "s", "k", FP, commit=True) as retry:
            assert retry.won
            conn.execute("INSERT INTO effects VALUES ('k')")
            retry.respond(Response(201, body=b"done"))
    assert retry.stored
    assert effects(dsn, "k") == 1


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_commit_after_the_transaction_ended_is_refused(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore, end: str
) -> None:
    # A misuse: the transaction begin() opened ended in between. Its completion would run alone,
    # find no claim (or one committed without its response) and COMMIT nothing, while commit()
    # answered as if the response were stored.
    won = store.begin(conn, "s", "k", FP)
    assert isinstance(won, Won)
    getattr(conn, end)()
    with pytest.raises(UsageError, match=r"ended before commit\(\)"):
        store.commit(conn, won, Response(201, body=b"done"))
    with psycopg.connect(dsn, autocommit=True) as other:
        row = other.execute("SELECT response_headers FROM pgonce.keys").fetchall()
    assert row == ([(None,)] if end == "commit" else [])  # never a stored response


def test_a_deferred_constraint_the_work_broke_is_raised_as_psycopg_raised_it(
    dsn: str, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    # COMMIT refuses the transaction for the caller's write, not for pgonce's completion: the
    # caller gets the error it can handle (here a foreign key; a serialization failure alike).
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE parents (id int PRIMARY KEY)")
        admin.execute(
            "CREATE TABLE children (parent int REFERENCES parents DEFERRABLE INITIALLY DEFERRED)"
        )
    won = store.begin(conn, "s", "k", FP)
    assert isinstance(won, Won)
    conn.execute("INSERT INTO children VALUES (1)")  # no parent: checked at COMMIT
    with pytest.raises(psycopg.errors.ForeignKeyViolation):
        store.commit(conn, won, Response(201))
    _idle_and_usable(conn)
    assert isinstance(store.begin(conn, "s", "k", FP), Won)  # the key stayed free
    conn.rollback()
