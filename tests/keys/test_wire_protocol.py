"""What a batch does when the server's answers are not the one result per statement it expects,
or when psycopg finishes a round trip that pgonce no longer reads: the connection is never left
in a state its next user could misread, and nothing hangs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgonce import KeyStore, Replay, Response, Won, fingerprint
from pgonce.errors import UsageError
from pgonce.store import wire
from tests.keys.helpers import wait_until_blocked

ROOT = Path(__file__).resolve().parents[2]
FP = fingerprint("wire protocol")

# A block whose queued write is a COPY, run in a process of its own: a batch that cannot read
# past the COPY's answer must fail, not spin in the caller's thread forever.
_COPY_BLOCK = textwrap.dedent(
    """
    import asyncio, sys
    import psycopg
    from pgonce import AsyncKeyStore, KeyStore, Response, fingerprint

    dsn, copy, mode = sys.argv[1:]
    FP = fingerprint("wire protocol")

    def sync() -> None:
        store = KeyStore(schema="pgonce")
        with psycopg.connect(dsn) as conn:
            try:
                with store.once(conn, "s", "k", FP, commit=mode == "owned") as op:
                    op.execute(copy)
                    op.respond(Response(201))
                conn.commit()
            except Exception as error:
                print(type(error).__name__, conn.closed, error)
            else:
                print("ok")

    async def run_async() -> None:
        store = AsyncKeyStore(schema="pgonce")
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            try:
                async with store.once(conn, "s", "k", FP, commit=mode == "owned") as op:
                    op.execute(copy)
                    op.respond(Response(201))
                await conn.commit()
            except Exception as error:
                print(type(error).__name__, conn.closed, error)
            else:
                print("ok")

    if mode.endswith("async"):
        mode = mode.removesuffix("-async")
        asyncio.run(run_async())
    else:
        sync()
    """
)


def _run_block(dsn: str, copy: str, mode: str) -> str:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _COPY_BLOCK, dsn, copy, mode],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=20,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{mode}: a batch with {copy!r} among its writes never returned")
    assert done.returncode == 0, done.stderr
    return done.stdout


MODES = ["owned", "joined", "owned-async", "joined-async"]


@pytest.mark.parametrize("mode", MODES)
def test_a_copy_from_stdin_among_queued_writes_is_an_error_not_a_hang(dsn: str, mode: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE t (x int)")
    said = _run_block(dsn, "COPY t FROM STDIN", mode)
    # Refused loudly; the connection, whose server side is in the COPY, is closed.
    assert said.startswith("DatabaseError True "), said
    assert "COPY FROM STDIN cannot run" in said
    # Nothing of the block committed: the key is free.
    store = KeyStore(schema="pgonce")
    with psycopg.connect(dsn) as conn:
        assert isinstance(store.begin(conn, "s", "k", FP), Won)
        conn.rollback()


@pytest.mark.parametrize("mode", MODES)
def test_a_copy_to_stdout_among_queued_writes_runs_like_a_select(dsn: str, mode: str) -> None:
    # The server runs a COPY TO STDOUT, and everything after it, without waiting for the client
    # (COMMIT too): the batch reads it to its end, and reports what the server did.
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("CREATE TABLE t (x int)")
    copy = "COPY (SELECT g, repeat('x', 100) FROM generate_series(1, 100000) AS g) TO STDOUT"
    said = _run_block(dsn, copy, mode)
    assert said == "ok\n", said
    store = KeyStore(schema="pgonce")
    with psycopg.connect(dsn) as conn:
        replay = store.begin(conn, "s", "k", FP)
        assert isinstance(replay, Replay)
        assert replay.response == Response(201)


def test_an_interrupted_sync_round_trip_closes_the_connection(dsn: str, store: KeyStore) -> None:
    # Ctrl-C in a sync batch: psycopg's wait cancels the statement, reads the round trip to its
    # end and raises KeyboardInterrupt, and the batch's answers never reach pgonce. Had the
    # connection stayed open, the statements the batch prepared there would be unknown to
    # pgonce: its next preparation fails on the name (42P05), which means a pooler that shares
    # sessions, and from then on every connection that lets psycopg prepare is refused.
    with (
        psycopg.connect(dsn) as first,
        psycopg.connect(dsn) as second,
        psycopg.connect(dsn, autocommit=True) as observer,
    ):
        assert isinstance(store.begin(first, "s", "k", FP), Won)

        def interrupt_when_blocked() -> None:
            wait_until_blocked(observer, second.info.backend_pid)
            os.kill(os.getpid(), signal.SIGINT)

        thread = threading.Thread(target=interrupt_when_blocked)
        thread.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                store.begin(second, "s", "k", FP, wait=timedelta(seconds=30))
        finally:
            thread.join()
        first.rollback()

        def claims_go_on(conn: psycopg.Connection[Any]) -> None:
            for key in ("a", "b"):
                claim = store.begin(conn, "s", key, FP)
                assert isinstance(claim, Won)
                assert store.commit(conn, claim, Response(201)) is True

        # The next claims go through, on this connection if it is still open, else on a new one.
        if second.closed:
            with psycopg.connect(dsn) as conn:
                claims_go_on(conn)
        else:
            second.rollback()
            claims_go_on(second)
        assert not wire.statements_crossed()
        assert second.closed


def test_a_batch_that_meets_a_deallocated_name_keeps_what_it_prepared(
    dsn: str, store: KeyStore
) -> None:
    # DEALLOCATE ALL behind psycopg's back (a pool's reset, while psycopg held no names of its
    # own), then a batch that prepares a statement new to the connection (BEGIN for another
    # isolation level) before one whose name is gone (the claim): that name fails (26000), the
    # new one exists. Forgetting both made the retry prepare the new one again (42P05), which
    # means a pooler that shares sessions, and every later claim on a connection that lets
    # psycopg prepare was refused.
    with psycopg.connect(dsn, autocommit=True) as conn:
        claim = store.begin(conn, "s", "a", FP)
        assert store.commit(conn, claim, Response(201)) is True
        conn.execute("DEALLOCATE ALL")
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        for key in ("b", "c", "d"):
            claim = store.begin(conn, "s", key, FP)
            assert isinstance(claim, Won)
            assert store.commit(conn, claim, Response(201)) is True
    assert not wire.statements_crossed()
    assert not wire.statements_unnamed()


@pytest.mark.parametrize("end", ["rollback", "commit"])
def test_a_rollback_inside_an_owned_block_is_never_a_silent_duplicate(
    dsn: str, store: KeyStore, end: str
) -> None:
    # A rollback there ended the claim's transaction, psycopg opened another at the next
    # statement, and commit() committed that work without the claim: run again at every retry.
    # psycopg now counts the block as its own transaction block and refuses the call.
    with psycopg.connect(dsn) as conn:
        conn.execute("CREATE TABLE effects (n int)")
        conn.commit()
        for _ in range(2):
            refused = pytest.raises(psycopg.ProgrammingError, match=f"Explicit {end}")
            with refused, store.once(conn, "s", "k", FP, commit=True) as op:
                try:
                    conn.execute("SELECT 1/0")
                except psycopg.errors.DivisionByZero:
                    getattr(conn, end)()
                conn.execute("INSERT INTO effects VALUES (1)")
                op.respond(Response(201))
        assert conn.execute("SELECT count(*) FROM effects").fetchone() == (0,)
        conn.rollback()
        # A savepoint of the block's own is psycopg's nested block, and the block commits.
        with store.once(conn, "s", "k", FP, commit=True) as op:
            with contextlib.suppress(psycopg.errors.DivisionByZero), conn.transaction():
                conn.execute("SELECT 1/0")
            conn.execute("INSERT INTO effects VALUES (1)")
            op.respond(Response(201))
        assert op.stored
        conn.commit()  # allowed again once the block ended
        assert conn.execute("SELECT count(*) FROM effects").fetchone() == (1,)


def test_a_decorated_call_that_owns_its_transaction_cannot_end_it(dsn: str) -> None:
    from pgonce import idempotent

    @idempotent(key="order", commit=True)
    def pay(conn: psycopg.Connection[Any], order: str) -> str:
        conn.execute("INSERT INTO effects VALUES (1)")
        conn.commit()  # would have committed the effect without the claim
        return order

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (n int)")
        for _ in range(2):
            with pytest.raises(UsageError, match="owns the transaction") as refused:
                pay(conn, "o-1")
            assert isinstance(refused.value.__cause__, psycopg.ProgrammingError)
        assert conn.execute("SELECT count(*) FROM effects").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)


@pytest.mark.parametrize("owned", [True, False])
def test_a_queued_write_whose_result_type_changed_fails_once(
    dsn: str, store: KeyStore, owned: bool
) -> None:
    # A queued write is prepared at its first run; an ALTER TABLE on another connection then
    # changes what its RETURNING * returns, and PostgreSQL refuses the prepared statement
    # (0A000) at every later run on that connection unless it is prepared anew.
    with psycopg.connect(dsn, autocommit=True) as admin, psycopg.connect(dsn) as conn:
        admin.execute("CREATE TABLE t (a int)")
        said = []
        for n in range(4):
            if n == 1:
                admin.execute("ALTER TABLE t ADD COLUMN b int")
            try:
                with store.once(conn, "s", f"k{n}", FP, commit=owned) as op:
                    op.execute("INSERT INTO t VALUES (%s) RETURNING *", (n,))
                    op.respond(Response(201))
                conn.commit()
                said.append("stored" if op.stored else "not stored")
            except psycopg.errors.FeatureNotSupported:
                conn.rollback()
                said.append("refused")
        assert said == ["stored", "refused", "stored", "stored"]
