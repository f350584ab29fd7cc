"""An outbox event enqueued from a session whose writes go through another engine (``binds=``
per mapper): the event is on the session's own engine, the writes it tells of on the other's,
and the session's commit ends the two transactions apart, so the event can be published for
writes that never committed. The commit of such a session is a UsageError, and nothing of it
commits; a session on one engine commits both as before.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import scoped_session, sessionmaker

from pgonce.contrib.sqlalchemy import async_enqueue, enqueue
from pgonce.errors import UsageError
from tests.sqlalchemy_adapter.models import Order
from tests.sqlalchemy_adapter.outbox_engines import (
    REFUSED,
    assert_commit_refused,
    committed,
    written,
)


def test_an_event_and_writes_on_two_engines_do_not_commit(
    engine: Engine, other: Engine, dsn: str
) -> None:
    assert_commit_refused(engine, other, dsn, REFUSED)
    # The writes flushed before the event count as much as those after it.
    scoped = scoped_session(sessionmaker(bind=engine, binds={Order: other}))
    with pytest.raises(UsageError, match=REFUSED), scoped.begin():
        enqueue(scoped(), "order", "k", "order.created", {})
        scoped.add(Order(key="k"))
    scoped.remove()
    assert committed(dsn) == ([], 0)


def test_one_engine_commits_the_event_with_the_writes(engine: Engine, dsn: str) -> None:
    with written(engine, engine) as session:
        session.commit()
        # The next transaction, without events, is not checked.
        session.add(Order(key="l"))
        session.commit()
    assert committed(dsn) == (["k", "l"], 1)


async def test_async_an_event_and_writes_on_two_engines_do_not_commit(
    async_engine: AsyncEngine, async_other: AsyncEngine, dsn: str
) -> None:
    async with AsyncSession(bind=async_engine, binds={Order: async_other}) as session:
        session.add(Order(key="k"))
        await async_enqueue(session, "order", "k", "order.created", {})
        with pytest.raises(UsageError, match=REFUSED):
            await session.commit()
    assert committed(dsn) == ([], 0)
