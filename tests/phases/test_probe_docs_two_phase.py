""" "Choosing a mode" says that a two-phase answer is stored with the token in a transaction of
its own, which can carry the last writes too: ``finish(response, writes=...)`` commits them with
the answer, and a holder taken over commits neither."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce import LeaseLost, Replay, Response
from pgonce.phases import PhaseStore
from tests.phases.racer import FP, T0

LEASE = timedelta(seconds=30)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ledger(db: psycopg.Connection[Any]) -> list[str]:
    return [row[0] for row in db.execute("SELECT what FROM ledger ORDER BY what")]


def test_the_last_writes_commit_with_the_answer(dsn: str, db: psycopg.Connection[Any]) -> None:
    db.execute("CREATE TABLE ledger (what text)")
    store = PhaseStore(lease=LEASE)
    with psycopg.connect(dsn, autocommit=True) as conn:
        op = store.start(conn, "s", "k", FP, now=T0)

        def writes(c: psycopg.Connection[Any]) -> None:
            c.execute("INSERT INTO ledger VALUES ('charged')")

        assert op.finish(Response(201, body=b"done"), writes=writes, now=at(1))
        again = store.start(conn, "s", "k", FP, now=at(2))
        assert isinstance(again.claim, Replay)
        assert again.response == Response(201, body=b"done")
    assert ledger(db) == ["charged"]


def test_a_holder_taken_over_commits_neither_its_writes_nor_its_answer(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    db.execute("CREATE TABLE ledger (what text)")
    store = PhaseStore(lease=LEASE)
    with (
        psycopg.connect(dsn, autocommit=True) as first_conn,
        psycopg.connect(dsn, autocommit=True) as second_conn,
    ):
        first = store.start(first_conn, "s", "k", FP, now=T0)
        second = store.start(second_conn, "s", "k", FP, now=at(31))  # the lease ran out
        assert second.won
        assert second.resumed

        def writes(c: psycopg.Connection[Any]) -> None:
            c.execute("INSERT INTO ledger VALUES ('zombie')")

        with pytest.raises(LeaseLost):
            first.finish(Response(201, body=b"zombie"), writes=writes, now=at(32))
        assert second.finish(Response(201, body=b"done"), now=at(33))
    assert ledger(db) == []
    row = db.execute("SELECT response_body FROM pgonce.keys WHERE key = 'k'").fetchone()
    assert row is not None
    assert bytes(row[0]) == b"done"
