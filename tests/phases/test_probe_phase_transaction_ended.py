"""A phase's work that ends the phase's transaction itself (a COMMIT or ROLLBACK sent as SQL).

The phase's recovery point must commit in the same transaction as its writes. A ROLLBACK in the
work undid the writes and the point was then recorded on its own: a retry skipped a phase whose
writes were gone. A COMMIT committed the writes ahead of the fenced record (a holder already
taken over wrote anyway). Both are refused now, before anything is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce import Response, UsageError
from pgonce.phases import AsyncPhaseStore, PhaseStore
from tests.phases.racer import FP, T0


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE IF NOT EXISTS ledger (key text)")
        yield c


def point_of(db: psycopg.Connection[Any], key: str) -> Any:
    row = db.execute("SELECT point FROM pgonce.key_leases WHERE key = %s", (key,)).fetchone()
    assert row is not None
    return row[0]


@pytest.mark.parametrize("autocommit", [True, False])
@pytest.mark.parametrize("end", ["ROLLBACK", "COMMIT"])
def test_a_phase_whose_work_ends_its_transaction_is_not_recorded(
    dsn: str, db: psycopg.Connection[Any], end: str, autocommit: bool
) -> None:
    with psycopg.connect(dsn, autocommit=autocommit) as conn:
        op = PhaseStore().start(conn, "s", "k", FP, now=T0)

        def write(c: psycopg.Connection[Any]) -> int:
            c.execute("INSERT INTO ledger VALUES ('k')")
            c.execute(end)
            return 1

        with pytest.raises(UsageError, match="ended the phase's transaction"):
            op.phase("write", write, now=at(1))
        assert op.state == {}
        assert op.point is None
        assert point_of(db, "k") is None
        # The holder is not stuck: the phase runs again, properly this time.
        assert op.phase("write", lambda c: c.execute("SELECT 1") and 2, now=at(2)) == 2
        assert point_of(db, "k") == "write"


def test_a_run_whose_phase_rolls_back_resumes_before_that_phase(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        store = PhaseStore()
        op = store.start(conn, "s", "run", FP, now=T0)

        def work(o: Any) -> Response:
            def write(c: psycopg.Connection[Any]) -> str:
                c.execute("INSERT INTO ledger VALUES ('run')")
                c.execute("ROLLBACK")
                return "written"

            o.phase("write", write, now=at(1))
            return Response(201, body=b"done")

        with pytest.raises(UsageError):
            op.run(work, now=at(1))
        again = store.start(conn, "s", "run", FP, now=at(2))
        assert again.won
        assert again.resumed
        assert again.point is None
        assert not again.reached("write")


async def test_an_async_phase_whose_work_rolls_back_is_not_recorded(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        op = await AsyncPhaseStore().start(conn, "s", "async", FP, now=T0)

        async def write(c: psycopg.AsyncConnection[Any]) -> int:
            await c.execute("INSERT INTO ledger VALUES ('async')")
            await c.execute("ROLLBACK")
            return 1

        with pytest.raises(UsageError, match="ended the phase's transaction"):
            await op.phase("write", write, now=at(1))
        assert point_of(db, "async") is None


def test_an_answer_whose_writes_end_the_transaction_is_not_stored(
    dsn: str, db: psycopg.Connection[Any]
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        op = PhaseStore().start(conn, "s", "answer", FP, now=T0)

        def writes(c: psycopg.Connection[Any]) -> None:
            c.execute("INSERT INTO ledger VALUES ('answer')")
            c.execute("ROLLBACK")

        with pytest.raises(UsageError, match="ended the answer's transaction"):
            op.finish(Response(201, body=b"done"), writes=writes, now=at(1))
        assert not op.stored
        row = db.execute("SELECT completed_at FROM pgonce.keys WHERE key = 'answer'").fetchone()
        assert row == (None,)
        assert op.finish(Response(201, body=b"done"), now=at(2))
