"""once(commit=True) owns its transaction on an idle connection; its failure paths are careful too.

The claim and the completion travel in batches (store/wire.py), the block's statements through
psycopg in between. Whatever goes wrong -- a failing statement, a Python exception, a connection
killed mid-block, prepared statements deallocated behind pgonce's back -- nothing commits, the key
stays free, and the caller's connection is handed back idle and usable.
"""

from __future__ import annotations

import select
from typing import Any

import psycopg
import pytest
from psycopg import pq
from psycopg.pq import TransactionStatus

from pgonce import AsyncKeyStore, KeyStore, Response, Won, fingerprint
from pgonce.errors import DatabaseUnavailable, NotInTransaction
from pgonce.store._sync.outbox import enqueue
from tests.keys.test_key_store import effects

FP = fingerprint("pipelined")


@pytest.fixture
def table(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (key text PRIMARY KEY, at timestamptz DEFAULT now())")


def test_failing_statement_surfaces_at_exit_and_rolls_everything_back(
    dsn: str, table: None, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    conn.execute("INSERT INTO effects (key) VALUES ('taken')")
    conn.commit()
    with (
        pytest.raises(psycopg.errors.UniqueViolation),
        store.once(conn, "s", "k", FP, commit=True) as op,
    ):
        conn.execute("INSERT INTO effects (key) VALUES ('k')")
        conn.execute("INSERT INTO effects (key) VALUES ('taken')")
        op.respond(Response(201, (), b"never stored"))
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert effects(dsn, "k") == 0
    with store.once(conn, "s", "k", FP, commit=True) as retry:
        assert retry.won
        conn.execute("INSERT INTO effects (key) VALUES ('k')")
        retry.respond(Response(201, (), b"stored"))
    assert retry.stored
    assert effects(dsn, "k") == 1


def test_exception_with_statements_still_queued_rolls_back(
    dsn: str, table: None, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    with pytest.raises(KeyError), store.once(conn, "s", "k", FP, commit=True):
        conn.execute("INSERT INTO effects (key) VALUES ('k')")
        raise KeyError("handler bug")
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert effects(dsn, "k") == 0
    with store.once(conn, "s", "k", FP, commit=True) as retry:
        assert retry.won


def test_block_may_fetch_its_own_results(
    table: None, conn: psycopg.Connection[Any], store: KeyStore
) -> None:
    with store.once(conn, "s", "k", FP, commit=True) as op:
        row = conn.execute("INSERT INTO effects (key) VALUES ('k') RETURNING key").fetchone()
        op.respond(Response(201, (), str(row).encode()))
    with store.once(conn, "s", "k", FP, commit=True) as again:
        assert again.replayed
    assert again.response == Response(201, (), b"('k',)")


def test_autocommit_connection_gets_a_transaction_of_its_own(
    dsn: str, table: None, store: KeyStore
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(RuntimeError), store.once(conn, "s", "k", FP, commit=True):
            conn.execute("INSERT INTO effects (key) VALUES ('k')")
            raise RuntimeError
        assert effects(dsn, "k") == 0
        with store.once(conn, "s", "k", FP, commit=True) as op:
            conn.execute("INSERT INTO effects (key) VALUES ('k')")
            op.respond(Response(201, (), b"ok"))
        assert op.stored
        assert conn.info.transaction_status == TransactionStatus.IDLE
    assert effects(dsn, "k") == 1


def test_inside_the_callers_pipeline(dsn: str, table: None, store: KeyStore) -> None:
    with psycopg.connect(dsn) as conn, conn.pipeline():
        with store.once(conn, "s", "k", FP) as op:
            conn.execute("INSERT INTO effects (key) VALUES ('k')")
            op.respond(Response(201, (), b"ok"))
        assert op.stored  # known before the pipeline syncs on its own
        conn.commit()
    assert effects(dsn, "k") == 1


def test_an_autocommit_pipeline_outside_a_transaction_is_refused(
    dsn: str, table: None, store: KeyStore
) -> None:
    # In a pipeline the status is ACTIVE once a statement is queued, transaction or not: an
    # autocommit connection's claim or outbox row there would commit alone at the next sync,
    # apart from the write queued before it.
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.pipeline():
            conn.execute("INSERT INTO effects (key) VALUES ('before')")
            assert conn.info.transaction_status == TransactionStatus.ACTIVE
            with pytest.raises(NotInTransaction), store.once(conn, "s", "k", FP):
                pass
            with pytest.raises(NotInTransaction):
                store.claim(conn, "s", "k", FP)
            with pytest.raises(NotInTransaction):
                enqueue(conn, "order", "1", "order.created", {})
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM pgonce.outbox").fetchone() == (0,)
        # Inside conn.transaction() the same pipeline joins it: all commit together.
        with conn.pipeline(), conn.transaction():
            conn.execute("INSERT INTO effects (key) VALUES ('k')")
            with store.once(conn, "s", "k", FP) as op:
                op.respond(Response(201, (), b"ok"))
            enqueue(conn, "order", "1", "order.created", {})
        assert op.stored
    assert effects(dsn, "k") == 1


def test_complete_in_the_callers_pipeline_says_whether_it_stored(
    dsn: str, table: None, store: KeyStore
) -> None:
    with psycopg.connect(dsn) as conn, conn.pipeline():
        claim = store.claim(conn, "s", "k", FP)
        assert isinstance(claim, Won)
        assert store.complete(conn, claim, Response(201, (), b"ok"))
        assert not store.complete(conn, claim, Response(201, (), b"again"))
        conn.commit()
    with psycopg.connect(dsn) as again, store.once(again, "s", "k", FP) as replay:
        assert replay.replayed
    assert replay.response == Response(201, (), b"ok")


async def test_async_once_in_the_callers_pipeline_reports_stored(
    dsn: str, table: None, astore: AsyncKeyStore
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.pipeline():
        async with astore.once(conn, "s", "k", FP) as op:
            await conn.execute("INSERT INTO effects (key) VALUES ('k')")
            op.respond(Response(201, (), b"ok"))
        assert op.stored
        await conn.commit()
    assert effects(dsn, "k") == 1


def test_connection_killed_mid_block_commits_nothing(
    dsn: str, table: None, store: KeyStore
) -> None:
    with (
        psycopg.connect(dsn) as conn,
        psycopg.connect(dsn, autocommit=True) as killer,
        pytest.raises(DatabaseUnavailable),
        store.once(conn, "s", "k", FP, commit=True) as op,
    ):
        conn.execute("INSERT INTO effects (key) VALUES ('k')")
        killer.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        op.respond(Response(201, (), b"lost"))
    assert effects(dsn, "k") == 0
    with psycopg.connect(dsn) as conn, store.once(conn, "s", "k", FP, commit=True) as retry:
        assert retry.won


async def test_async_failure_path_hands_back_a_clean_connection(
    dsn: str, table: None, aconn: psycopg.AsyncConnection[Any], astore: AsyncKeyStore
) -> None:
    await aconn.execute("INSERT INTO effects (key) VALUES ('taken')")
    await aconn.commit()
    with pytest.raises(psycopg.errors.UniqueViolation):
        async with astore.once(aconn, "s", "k", FP, commit=True) as op:
            await aconn.execute("INSERT INTO effects (key) VALUES ('taken')")
            op.respond(Response(201, (), b"never"))
    assert aconn.info.transaction_status == TransactionStatus.IDLE
    async with astore.once(aconn, "s", "k", FP, commit=True) as retry:
        assert retry.won
        await aconn.execute("INSERT INTO effects (key) VALUES ('k')")
        retry.respond(Response(201, (), b"ok"))
    assert retry.stored
    assert effects(dsn, "k") == 1


@pytest.mark.parametrize("respond", [True, False])
def test_error_that_arrives_before_the_completion_is_queued(
    dsn: str, table: None, conn: psycopg.Connection[Any], store: KeyStore, respond: bool
) -> None:
    # Found by CI: when the failing statement's answer is already on the socket, it surfaces
    # while the completion (or COMMIT) is being queued -- the pipeline must still be left.
    conn.execute("INSERT INTO effects (key) VALUES ('taken')")
    conn.commit()
    with (
        pytest.raises(psycopg.errors.UniqueViolation),
        store.once(conn, "s", "k", FP, commit=True) as op,
    ):
        conn.execute("INSERT INTO effects (key) VALUES ('taken')")
        # Wait (bounded) until PostgreSQL's answer, the error, is readable on the socket.
        assert select.select([conn.pgconn.socket], [], [], 10)[0]
        if respond:
            op.respond(Response(201, (), b"never stored"))
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert conn.pgconn.pipeline_status == pq.PipelineStatus.OFF
    assert conn.execute("SELECT 1").fetchone() == (1,)
    assert effects(dsn, "k") == 0
