"""Outbox events enqueued in a once() block whose transaction the block ended in a way pgonce
cannot refuse before it commits: psycopg's ``Connection.commit`` called on the class, a bound
``commit`` taken before the block, a COMMIT in SQL. The driver commits the claim and the events
with it, and pgonce sees the end only at the block's end.

The block's ORM objects not flushed yet when its transaction committed were never written,
and pgonce stored the block's response anyway: a retry replayed 201 for an order that does not
exist while the relay published its event. Now nothing is stored (the committed claim stays in
flight), and each error names the outbox events that the end took with it. Real sessions on a
real PostgreSQL, counted from another connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from pgonce import Response, fingerprint
from pgonce.contrib.sqlalchemy import async_enqueue, async_once, enqueue, once
from pgonce.errors import UsageError
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order

FP = fingerprint("POST", "/orders", b"{}")
CREATED = Response(201, body=b"created")


def events(dsn: str) -> list[tuple[int, str]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        return [(r[0], r[1]) for r in c.execute("SELECT id, type FROM pgonce.outbox ORDER BY id")]


def _retry(engine: Engine) -> tuple[bool, Response | None]:
    with Session(engine) as session, session.begin(), once(session, "t", "k", FP) as op:
        if op.won:
            session.add(Order(key="retry"))
            op.respond(CREATED)
    return op.won, op.response


def _driver(session: Session) -> Any:
    return session.connection().connection.driver_connection


ENDS: dict[str, Callable[[Any], object]] = {
    "class": lambda driver: psycopg.Connection.commit(driver),
    "sql": lambda driver: driver.execute("COMMIT"),
}


@pytest.mark.parametrize("end", ENDS)
def test_unflushed_objects_at_a_commit_in_the_block_store_no_response(
    dsn: str, engine: Engine, end: str
) -> None:
    with (
        Session(engine) as session,
        pytest.raises(UsageError) as raised,
        once(session, "t", "k", FP) as op,
    ):
        session.add(Order(key="k"))  # pending: not flushed before the commit
        event = enqueue(session, "order", "k", "order.created", {})
        ENDS[end](_driver(session))
        op.respond(CREATED)
    message = str(raised.value)
    assert "1 ORM object(s) of the block not flushed yet" in message
    assert "no response was stored" in message
    assert f"outbox events {event} enqueued in the block" in message
    # What the driver's commit took: the claim (in flight, no response) and the event.
    assert stored(dsn) == ([], [("k", None)])
    assert events(dsn) == [(event, "order.created")]
    assert _retry(engine) == (False, None)  # in flight: neither a replay of 201 nor a new run


def test_a_commit_in_the_block_with_everything_flushed_names_the_committed_events(
    dsn: str, engine: Engine
) -> None:
    with (
        Session(engine) as session,
        pytest.raises(UsageError) as raised,
        once(session, "t", "k", FP) as op,
    ):
        session.add(Order(key="k"))
        session.flush()
        event = enqueue(session, "order", "k", "order.created", {})
        psycopg.Connection.commit(_driver(session))
        op.respond(CREATED)
    assert "a retry replays it" in str(raised.value)
    assert f"outbox events {event} enqueued in the block committed with the claim" in str(
        raised.value
    )
    assert stored(dsn) == (["k"], [("k", 201)])
    assert events(dsn) == [(event, "order.created")]
    assert _retry(engine) == (False, CREATED)


def test_a_block_that_went_on_after_its_commit_names_the_events(dsn: str, engine: Engine) -> None:
    with Session(engine) as session:
        with (
            pytest.raises(UsageError, match="savepoint was gone") as raised,
            once(session, "t", "k", FP) as op,
        ):
            first = enqueue(session, "order", "k", "order.created", {})
            _driver(session).execute("COMMIT")
            later = enqueue(session, "order", "k", "order.paid", {})  # a new transaction
            op.respond(CREATED)
        session.rollback()
    assert f"outbox events {first}, {later} enqueued in the block" in str(raised.value)
    assert events(dsn) == [(first, "order.created")]
    assert stored(dsn) == ([], [("k", None)])


async def test_async_unflushed_objects_at_a_commit_in_the_block_store_no_response(
    dsn: str, async_engine: AsyncEngine, engine: Engine
) -> None:
    async with AsyncSession(async_engine) as session:
        with pytest.raises(UsageError, match="not flushed yet") as raised:
            async with async_once(session, "t", "k", FP) as op:
                session.add(Order(key="k"))
                event = await async_enqueue(session, "order", "k", "order.created", {})
                raw = await (await session.connection()).get_raw_connection()
                driver: Any = raw.driver_connection
                await psycopg.AsyncConnection.commit(driver)
                op.respond(CREATED)
    assert f"outbox events {event} enqueued in the block" in str(raised.value)
    assert stored(dsn) == ([], [("k", None)])
    assert events(dsn) == [(event, "order.created")]
    assert _retry(engine) == (False, None)


def test_a_block_that_raised_after_its_commit_keeps_its_error_with_a_note(
    dsn: str, engine: Engine
) -> None:
    with (
        Session(engine) as session,
        pytest.raises(KeyError) as raised,
        once(session, "t", "k", FP),
    ):
        event = enqueue(session, "order", "k", "order.created", {})
        psycopg.Connection.commit(_driver(session))
        raise KeyError("the block's own")
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert f"outbox events {event} enqueued in the block" in notes
    assert events(dsn) == [(event, "order.created")]
    assert stored(dsn) == ([], [("k", None)])


@pytest.mark.parametrize("amount", [0, 5])
def test_a_changed_object_unflushed_at_the_commit_stores_no_response(
    dsn: str, engine: Engine, amount: int
) -> None:
    with Session(engine) as session, session.begin():
        session.add(Order(key="o", amount=0))
    with Session(engine) as session:
        order = session.get(Order, 1)
        assert order is not None
        with pytest.raises(UsageError) as raised, once(session, "t", "k", FP) as op:
            order.amount = amount  # 0: set to what it was, no change to write
            psycopg.Connection.commit(_driver(session))
            op.respond(CREATED)
    if amount:
        assert "1 ORM object(s) of the block not flushed yet" in str(raised.value)
        assert stored(dsn) == (["o"], [("k", None)])
    else:
        assert "a retry replays it" in str(raised.value)
        assert stored(dsn) == (["o"], [("k", 201)])
