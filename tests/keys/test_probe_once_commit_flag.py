"""once()'s ``commit`` given as something other than True or False (a setting read as text).

``commit="false"`` is truthy: the block owned a transaction and committed it at its end, on a
connection whose caller meant to join its own transaction and commit (or roll back) later;
``commit=0`` joined where ``1`` was meant. Refused at the call, as ``@idempotent`` refuses it.
"""

from __future__ import annotations

import psycopg
import pytest

from pgonce import AsyncKeyStore, KeyStore, UsageError, fingerprint

FP = fingerprint("flag")


@pytest.mark.parametrize("commit", ["false", "true", 0, 1, None], ids=repr)
def test_a_commit_that_is_not_a_bool_is_refused(dsn: str, store: KeyStore, commit: object) -> None:
    with psycopg.connect(dsn) as conn:
        with pytest.raises(UsageError, match="once\\(\\)'s commit must be True or False"):
            store.once(conn, "s", "k", FP, commit=commit)  # type: ignore[arg-type]
        conn.rollback()
        assert conn.execute("SELECT count(*) FROM pgonce.keys").fetchone() == (0,)


async def test_the_async_store_refuses_it_too(dsn: str, astore: AsyncKeyStore) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        with pytest.raises(UsageError, match="once\\(\\)'s commit must be True or False"):
            astore.once(conn, "s", "k", FP, commit="false")  # type: ignore[arg-type]
