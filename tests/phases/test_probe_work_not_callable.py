"""Work that is not a function, handed to a phase, a call, an answer's writes or a run.

A call's work that could not be called failed as a bare TypeError after the lease had been
renewed and the holder marked as having called the third party: its key, never offered to
anyone, could then not be released. Each is a UsageError before anything is written now.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce import Response, UsageError
from pgonce.phases import AsyncPhaseStore, PhaseStore
from tests.phases.racer import FP, T0


def test_a_call_whose_work_is_not_a_function_leaves_the_key_releasable(
    db: psycopg.Connection[Any],
) -> None:
    op = PhaseStore().start(db, "s", "call", FP, now=T0)
    with pytest.raises(UsageError, match="call 'charge''s work must be a function"):
        op.call("charge", "https://provider.example/charge")  # type: ignore[arg-type]
    op.release()
    assert db.execute("SELECT count(*) FROM pgonce.keys WHERE key = 'call'").fetchone() == (0,)


@pytest.mark.parametrize("where", ["phase", "finish", "run"])
def test_work_that_is_not_a_function_is_a_usage_error(
    db: psycopg.Connection[Any], where: str
) -> None:
    op = PhaseStore().start(db, "s", where, FP, now=T0)
    with pytest.raises(UsageError, match="must be a function"):
        if where == "phase":
            op.phase("write", 5)  # type: ignore[arg-type]
        elif where == "finish":
            op.finish(Response(201), writes=5)  # type: ignore[arg-type]
        else:
            op.run(5)  # type: ignore[arg-type]
    assert op.phase("write", lambda c: 1) == 1


async def test_an_async_call_whose_work_is_not_a_function(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        op = await AsyncPhaseStore().start(conn, "s", "async", FP, now=T0)
        with pytest.raises(UsageError, match="must be a function"):
            await op.call("charge", None)  # type: ignore[arg-type]
        await op.release()
