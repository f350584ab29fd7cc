""" "How a claim works" says that replays write nothing: a duplicate that finds the key completed
takes no transaction id and leaves the row as it was, whichever way it claims."""

from __future__ import annotations

from typing import Any

import psycopg

from pgonce import KeyStore, Replay, Response, fingerprint

FP = fingerprint(b"the request")
ANSWER = Response(201, body=b"done")


def row_version(conn: psycopg.Connection[Any]) -> tuple[str, str]:
    """The key's row version: its ctid and xmin, which any write of it would change."""
    row = conn.execute("SELECT ctid::text, xmin::text FROM pgonce.keys").fetchone()
    assert row is not None
    return row[0], row[1]


def xid_assigned(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("SELECT pg_current_xact_id_if_assigned() IS NOT NULL").fetchone()
    assert row is not None
    return bool(row[0])


def test_a_replay_writes_nothing_however_it_is_claimed(dsn: str) -> None:
    store = KeyStore()
    with psycopg.connect(dsn, autocommit=True) as conn:
        with store.once(conn, "s", "k", FP, commit=True) as op:
            op.respond(ANSWER)
        assert op.stored
        before = row_version(conn)

        # In the caller's transaction: the savepoint's claim, then the bare claim().
        with conn.transaction():
            with store.once(conn, "s", "k", FP) as op:
                assert op.replayed
            assert not xid_assigned(conn)
            claimed = store.claim(conn, "s", "k", FP)
            assert isinstance(claimed, Replay)
            assert claimed.response == ANSWER
            assert not xid_assigned(conn)

        # In a transaction of pgonce's own.
        with store.once(conn, "s", "k", FP, commit=True) as op:
            assert op.replayed
        assert not op.stored
        begun = store.begin(conn, "s", "k", FP)
        assert isinstance(begun, Replay)
        assert begun.response == ANSWER

        assert row_version(conn) == before
