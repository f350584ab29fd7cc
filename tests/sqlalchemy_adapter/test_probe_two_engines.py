"""A session whose writes go through another engine than the claim's (``binds=`` per mapper,
a routing ``get_bind()``): those writes are in another transaction, which the session's commit
ends apart from the claim's, so a failure between the two commits stores the response without
the writes, and the retry replays it. once() and async_once() refuse such a block with a
UsageError, roll its writes back on both connections and leave the key free; a block that only
reads through the other engine (a replica, say) goes on as usual.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, insert, select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from pgonce import Response, fingerprint
from pgonce.contrib.sqlalchemy import async_once, once
from pgonce.errors import UsageError
from tests.sqlalchemy_adapter.conftest import stored
from tests.sqlalchemy_adapter.models import Order

FP = fingerprint("POST", "/orders", b"{}")
CREATED = Response(201, body=b"created")
REFUSED = "connection other than the claim's"


def test_orm_writes_through_another_engine_are_refused_and_nothing_commits(
    engine: Engine, other: Engine, dsn: str
) -> None:
    with Session(bind=engine, binds={Order: other}) as session:
        with pytest.raises(UsageError, match=REFUSED), once(session, "t", "k", FP) as op:
            session.add(Order(key="k"))
            op.respond(CREATED)
        session.commit()
    assert stored(dsn) == ([], [])


def test_a_core_insert_routed_to_another_engine_is_refused_too(
    engine: Engine, other: Engine, dsn: str
) -> None:
    with Session(bind=engine, binds={Order: other}) as session:
        with pytest.raises(UsageError, match=REFUSED), once(session, "t", "k", FP) as op:
            session.execute(insert(Order).values(key="k"))
            op.respond(CREATED)
        session.commit()
    assert stored(dsn) == ([], [])
    # With the one engine for everything, the same block commits whole.
    with Session(bind=engine, binds={Order: engine}) as session:
        with once(session, "t", "k", FP) as op:
            session.execute(insert(Order).values(key="k"))
            op.respond(CREATED)
        session.commit()
    assert stored(dsn) == (["k"], [("k", 201)])


def test_reads_through_another_engine_are_no_writes(
    engine: Engine, other: Engine, dsn: str
) -> None:
    with Session(bind=engine, binds={Order: other}) as session:
        with once(session, "t", "k", FP) as op:
            assert session.scalars(select(Order)).all() == []  # on the other engine
            session.execute(text("INSERT INTO orders (key, amount) VALUES ('k', 0)"))
            op.respond(CREATED)
        session.commit()
    assert stored(dsn) == (["k"], [("k", 201)])


async def test_async_orm_writes_through_another_engine_are_refused(
    async_engine: AsyncEngine, async_other: AsyncEngine, dsn: str
) -> None:
    async with AsyncSession(bind=async_engine, binds={Order: async_other}) as session:
        with pytest.raises(UsageError, match=REFUSED):
            async with async_once(session, "t", "k", FP) as op:
                session.add(Order(key="k"))
                op.respond(CREATED)
        await session.commit()
    assert stored(dsn) == ([], [])
