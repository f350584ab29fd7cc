"""once() is a savepoint of the session's own: what the database undoes, the session forgets too.

Each test here failed when once() rolled back a savepoint that SQLAlchemy knew nothing about: the
block's pending objects committed after an exception the caller caught, writes made before the
block were flushed inside it and lost with it, and a failed flush left the caller's transaction
aborted. Real sessions on a real PostgreSQL, counted from another connection.
"""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, create_engine, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from pgonce import Response, fingerprint
from pgonce.contrib.sqlalchemy import async_enqueue, async_once, enqueue, once
from pgonce.errors import DatabaseUnavailable, NotInTransaction, UsageError
from tests.sqlalchemy_adapter.models import Order, orders_and_rows

FP = fingerprint("POST", "/orders", b"{}")
CREATED = Response(201, body=b"created")


class Refused(Exception):
    pass


def stored(dsn: str) -> tuple[list[str], int]:
    """(the orders' keys, the number of stored keys), as another connection sees them."""
    return orders_and_rows(dsn, "keys")


def test_an_exception_caught_by_the_caller_discards_the_blocks_pending_objects(
    dsn: str, engine: Engine
) -> None:
    for attempt in range(2):  # a retry after the refusal: neither attempt may leave an order
        with Session(engine) as session, session.begin():
            try:
                with once(session, "tenant", "k", FP) as op:
                    assert op.won
                    session.add(Order(key="k"))  # pending, never flushed
                    raise Refused
            except Refused:
                session.add(Order(key=f"audit-{attempt}"))  # the caller goes on and commits
    assert stored(dsn) == (["audit-0", "audit-1"], 0)


async def test_async_an_exception_caught_by_the_caller_discards_the_blocks_pending_objects(
    dsn: str, async_engine: AsyncEngine
) -> None:
    async with AsyncSession(async_engine) as session, session.begin():
        try:
            async with async_once(session, "tenant", "k", FP) as op:
                assert op.won
                session.add(Order(key="k"))
                raise Refused
        except Refused:
            pass
        session.add(Order(key="after"))
    assert stored(dsn) == (["after"], 0)


def test_writes_before_the_block_survive_its_failure_and_its_unstored_5xx(
    dsn: str, engine: Engine
) -> None:
    with Session(engine) as session, session.begin():
        session.add(Order(key="before-failure"))  # pending when the block begins
        try:
            with once(session, "tenant", "k1", FP):
                session.add(Order(key="k1"))
                session.execute(select(Order))  # an autoflush inside the block
                raise Refused
        except Refused:
            pass
        assert session.get(Order, 2) is None  # the block's row is gone from the session too
        session.add(Order(key="before-5xx"))
        with once(session, "tenant", "k2", FP) as op:
            session.add(Order(key="k2"))
            op.respond(Response(503))  # not stored: the block is undone, the key stays free
        assert not op.stored
        assert session.scalars(select(Order.key).order_by(Order.key)).all() == [
            "before-5xx",
            "before-failure",
        ]
    assert stored(dsn) == (["before-5xx", "before-failure"], 0)


def test_a_failed_flush_under_the_callers_savepoint_leaves_its_transaction_usable(
    dsn: str, engine: Engine
) -> None:
    with Session(engine) as session, session.begin():
        session.add(Order(key="taken"))
    with Session(engine) as session, session.begin():
        with (  # SQLAlchemy's recipe: a savepoint around what may fail
            pytest.raises(IntegrityError),
            session.begin_nested(),
            once(session, "tenant", "k", FP) as op,
        ):
            session.add(Order(key="taken"))  # conflicts at once()'s flush
            op.respond(CREATED)
        session.add(Order(key="goes-on"))
        # No savepoint of the caller's: once()'s own is the one the failed flush rolls back.
        with pytest.raises(IntegrityError), once(session, "tenant", "k", FP) as op:
            session.add(Order(key="taken"))
            op.respond(CREATED)
        session.add(Order(key="goes-on-2"))  # the conflicting object was expunged with the block
    assert stored(dsn) == (["goes-on", "goes-on-2", "taken"], 0)


def test_a_savepoint_ended_inside_the_block_is_a_usage_error(dsn: str, engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        outer = session.begin_nested()
        with (
            pytest.raises(UsageError, match="savepoint opened before pgonce's"),
            once(session, "tenant", "k", FP) as op,
        ):
            session.add(Order(key="k"))
            outer.rollback()  # takes pgonce's savepoint with it
            op.respond(CREATED)
        session.rollback()
    assert stored(dsn) == ([], 0)


def test_a_scoped_session_is_its_sessions(dsn: str, engine: Engine) -> None:
    scoped = scoped_session(sessionmaker(engine))
    with scoped.begin(), once(scoped, "tenant", "k", FP) as op:  # type: ignore[arg-type]
        scoped.add(Order(key="k"))
        op.respond(CREATED)
    scoped.remove()
    assert stored(dsn) == (["k"], 1)


def test_what_is_not_a_session_is_refused_by_name(engine: Engine, dsn: str) -> None:
    with (
        pytest.raises(UsageError, match="expected a SQLAlchemy Session, not Engine"),
        once(engine, "tenant", "k", FP),  # type: ignore[arg-type]
    ):
        pass
    with pytest.raises(UsageError, match="not NoneType"):
        enqueue(None, "order", "1", "order.created", {})  # type: ignore[arg-type]
    with (
        Session(engine) as session,
        pytest.raises(UsageError, match="store must be a KeyStore, not str"),
        once(session, "tenant", "k", FP, store="x"),  # type: ignore[arg-type]
    ):
        pass
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    with (
        Session(autocommit) as session,
        pytest.raises(NotInTransaction),
        once(session, "tenant", "k", FP),
    ):
        pass
    unreachable = create_engine(  # nothing listens there
        "postgresql+psycopg://postgres@127.0.0.1:1/none", connect_args={"connect_timeout": 2}
    )
    with (
        Session(unreachable) as session,
        pytest.raises(DatabaseUnavailable, match="connecting through the session failed"),
        once(session, "tenant", "k", FP),
    ):
        pass
    assert stored(dsn) == ([], 0)


async def test_the_other_kind_of_session_is_named(
    dsn: str, engine: Engine, async_engine: AsyncEngine
) -> None:
    with Session(engine) as session:
        with pytest.raises(UsageError, match="not Session: use once"):
            async with async_once(session, "tenant", "k", FP):  # type: ignore[arg-type]
                pass
        with pytest.raises(UsageError, match="not Session: use once"):
            await async_enqueue(session, "order", "1", "order.created", {})  # type: ignore[arg-type]
    async with AsyncSession(async_engine) as async_session:
        with (
            pytest.raises(UsageError, match="not AsyncSession: use async_once"),
            once(async_session, "tenant", "k", FP),  # type: ignore[arg-type]
        ):
            pass

        def inside(sync: Session) -> None:
            with once(sync, "tenant", "k", FP):
                pass

        with pytest.raises(UsageError, match="runs on an async engine"):
            await async_session.run_sync(inside)
        await async_session.rollback()
    assert stored(dsn) == ([], 0)
