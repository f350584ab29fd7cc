"""What a phase returned is recorded as it was when the phase passed. The record kept the caller's
object itself: a change the request made to it afterwards (an item appended, a datetime added)
was written again with every later phase, so that a resume read a value the phase never returned
(and appended the item a second time), and a later phase failed as a bare TypeError, or as a
database error for a NaN, for a value it did not return."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from pgonce.phases import AsyncPhaseStore, PhaseStore
from tests.phases.racer import FP, T0

LATER = T0 + timedelta(minutes=5)


def recorded(db: psycopg.Connection[Any], key: str) -> Any:
    row = db.execute("SELECT state FROM pgonce.key_leases WHERE key = %s", (key,)).fetchone()
    assert row is not None
    return row[0]


def new_order(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    return {"id": 1, "items": []}


def test_a_value_changed_after_its_phase_is_not_recorded_again(
    db: psycopg.Connection[Any],
) -> None:
    store = PhaseStore()
    op = store.start(db, "s", "changed", FP, now=T0)
    order = op.phase("order", new_order, now=T0)
    order["items"].append("gift-wrap")
    order["at"] = datetime.now(UTC)  # not JSON: the request's own business
    order["nan"] = float("nan")
    assert op.phase("charge", lambda c: "ch_1", now=T0) == "ch_1"
    assert recorded(db, "changed") == {"order": {"id": 1, "items": []}, "charge": "ch_1"}
    assert op.state["order"] == {"id": 1, "items": []}

    # A resume reads what the phase returned, and changes to that do not reach the record either.
    retry = store.start(db, "s", "changed", FP, now=LATER)
    assert retry.resumed
    again = retry.phase("order", new_order, now=LATER)
    assert again == {"id": 1, "items": []}
    again["items"].append("gift-wrap")
    retry.call("ship", lambda key: {"label": "L1"}, now=LATER)
    assert recorded(db, "changed")["order"] == {"id": 1, "items": []}


async def test_an_async_value_changed_after_its_call_is_not_recorded_again(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        op = await AsyncPhaseStore().start(conn, "s", "async", FP, now=T0)

        async def charge(key: str) -> dict[str, Any]:
            return {"id": "ch_1", "refunds": []}

        made = await op.call("charge", charge, now=T0)
        made["refunds"].append(datetime.now(UTC))

        async def record(c: psycopg.AsyncConnection[Any]) -> int:
            return 1

        assert await op.phase("record", record, now=T0) == 1
        assert op.state == {"charge": {"id": "ch_1", "refunds": []}, "record": 1}
