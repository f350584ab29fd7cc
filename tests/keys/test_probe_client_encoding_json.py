"""A stored response whose headers go beyond ASCII, replayed by claim() on a connection whose
client_encoding is not UTF-8 (LATIN1).

The server sends the headers (jsonb) in the connection's encoding, and psycopg's JSON loaders read
them as UTF-8: the replay failed with a bare ``UnicodeDecodeError`` from inside psycopg. It is a
:class:`~pgonce.UsageError` that says what to change, and the caller's transaction goes on;
``once()`` outside psycopg's pipeline, which reads the row in the connection's encoding, replays.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import KeyStore, Replay, Response, UsageError, fingerprint

FP = fingerprint("encoded")
STORED = Response(200, headers=(("x-note", "café"),), body=b"{}")
INTRANS = psycopg.pq.TransactionStatus.INTRANS


def _latin1(dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, options="-c client_encoding=LATIN1")


def test_claim_on_a_latin1_connection_is_a_usage_error(dsn: str, store: KeyStore) -> None:
    with psycopg.connect(dsn) as conn:
        with store.once(conn, "s", "k", FP) as op:
            op.respond(STORED)
        conn.commit()
    with _latin1(dsn) as conn:
        with store.once(conn, "s", "k", FP) as op:
            assert op.replayed
            assert op.response == STORED
        with pytest.raises(UsageError, match="connect with client_encoding UTF8"):
            store.claim(conn, "s", "k", FP)
        assert conn.info.transaction_status == INTRANS
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the transaction goes on
        conn.rollback()
        with conn.pipeline(), conn.transaction():
            refused = pytest.raises(UsageError, match="connect with client_encoding UTF8")
            with refused, store.once(conn, "s", "k", FP):
                pass
            assert conn.execute("SELECT 1").fetchone() == (1,)
        claim = store.begin(conn, "s", "k", FP)
        assert isinstance(claim, Replay)
        assert claim.response == STORED
