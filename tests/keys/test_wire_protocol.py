"""What a batch does when the server's answers are not the one result per statement it expects,
or when psycopg finishes a round trip that pgonce no longer reads: the connection is never left
in a state its next user could misread, and nothing hangs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest

from pgonce import KeyStore, Replay, Response, Won, fingerprint

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
