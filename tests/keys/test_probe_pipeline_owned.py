"""once(commit=True) on an idle autocommit connection inside psycopg's pipeline.

pgonce's own transaction cannot begin there (its batches run outside the pipeline), and the
refusal said the connection was inside the caller's transaction and to call once() without
commit=True; that call, on the same autocommit pipeline, was refused in turn and told to pass
commit=True. Each refusal now names the pipeline, and neither sends the caller to the other.
"""

from __future__ import annotations

import psycopg
import pytest

from pgonce import KeyStore, NotInTransaction, UsageError, fingerprint

FP = fingerprint("piped")


def test_each_refusal_names_the_pipeline_and_not_the_other_call(dsn: str, store: KeyStore) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn, conn.pipeline():
        owned = pytest.raises(UsageError, match=r"outside conn\.pipeline\(\)")
        with owned, store.once(conn, "s", "k", FP, commit=True):
            pass
        with pytest.raises(NotInTransaction) as joined, store.once(conn, "s", "k", FP):
            pass
        assert "pass commit=True" not in str(joined.value)
        assert "conn.transaction()" in str(joined.value)
        with conn.transaction(), store.once(conn, "s", "k", FP) as op:  # what it says works
            assert op.won
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (1,)
