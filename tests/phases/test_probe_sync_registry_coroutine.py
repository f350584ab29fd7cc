"""An ``async def`` given to the sync store, as a completer's registered work or as a phase's or a
call's work. The completer took each request of that operation over, failed it ("returned an
awaitable"), and once its attempts ran out retired it with a stored 500: a mistake of
configuration ended real requests for good. A call counted as made, so that its key could no
longer be released. Each is a UsageError at the call now, before anything is taken or written."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce import Response, UsageError
from pgonce.phases import PhaseStore
from tests.phases.racer import FP, T0


async def pay(op: Any) -> Response:
    return Response(201)


async def charge(key: str) -> dict[str, str]:
    return {"id": "ch_1"}


def test_a_sync_completer_given_an_async_work_retires_nothing(
    db: psycopg.Connection[Any],
) -> None:
    store = PhaseStore()
    store.start(db, "s", "pay-1", FP, operation="pay", now=T0)
    later = T0 + timedelta(minutes=1)
    for attempt in range(3):
        with pytest.raises(UsageError, match=r"registered work of 'pay'.*async def"):
            store.complete(
                db,
                {"pay": pay},  # type: ignore[dict-item]
                retire_after=1,
                now=later + timedelta(minutes=attempt),
            )
    row = db.execute(
        "SELECT k.completed_at, l.attempts, l.last_error FROM pgonce.keys AS k "
        "JOIN pgonce.key_leases AS l USING (scope, key) WHERE k.key = 'pay-1'"
    ).fetchone()
    assert row == (None, 1, None)


def test_a_sync_call_given_an_async_work_is_refused_before_it_counts_as_made(
    db: psycopg.Connection[Any],
) -> None:
    op = PhaseStore().start(db, "s", "call", FP, now=T0)
    with pytest.raises(UsageError, match=r"call 'charge''s work.*async def"):
        op.call("charge", charge, now=T0)  # type: ignore[unused-coroutine]
    # Nothing reached the third party: the request may still be released.
    op.release(now=T0)
    assert op.released
