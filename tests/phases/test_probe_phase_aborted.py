"""A phase's work that catches the failure of one of its statements and returns: the phase's
transaction is aborted, and the record was refused as "current transaction is aborted", a
DatabaseError that blamed pgonce's own write. It is a UsageError naming the work now."""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg
import pytest

from pgonce import Response, UsageError
from pgonce.phases import AsyncPhaseStore, PhaseStore
from tests.phases.racer import FP, T0


def swallow(conn: psycopg.Connection[Any]) -> int:
    with contextlib.suppress(psycopg.errors.DivisionByZero):
        conn.execute("SELECT 1 / 0")
    return 1


def swallow_writes(conn: psycopg.Connection[Any]) -> None:
    swallow(conn)


def test_a_phase_whose_work_swallows_a_failed_statement_is_a_usage_error(
    db: psycopg.Connection[Any],
) -> None:
    op = PhaseStore().start(db, "s", "k", FP, now=T0)
    with pytest.raises(UsageError, match="phase 'divide''s work returned in the phase's"):
        op.phase("divide", swallow)
    assert op.point is None
    # The holder goes on: its transaction was rolled back.
    assert op.phase("divide", lambda c: 2) == 2


def test_an_answer_whose_writes_swallow_a_failed_statement_is_not_stored(
    db: psycopg.Connection[Any],
) -> None:
    op = PhaseStore().start(db, "s", "answer", FP, now=T0)
    with pytest.raises(UsageError, match="the answer's writes returned"):
        op.finish(Response(201, body=b"done"), writes=swallow_writes)
    assert not op.stored
    assert op.finish(Response(201, body=b"done"))


async def test_an_async_phase_whose_work_swallows_a_failed_statement(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        op = await AsyncPhaseStore().start(conn, "s", "async", FP, now=T0)

        async def divide(c: psycopg.AsyncConnection[Any]) -> int:
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                await c.execute("SELECT 1 / 0")
            return 1

        with pytest.raises(UsageError, match="aborted by one of its statements"):
            await op.phase("divide", divide)
