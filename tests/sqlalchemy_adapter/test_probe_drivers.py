"""Engines on the wrong driver or the wrong side (sync or async) are refused by name, before
connecting.

A sync Session on a postgresql+asyncpg:// or postgresql+psycopg_async:// engine raised
SQLAlchemy's MissingGreenlet from the connect, an AsyncSession on asyncpg raised asyncpg's bare
OSError when its server was unreachable, and process_batch() on a psycopg_async engine raised
MissingGreenlet: none named the URL to use. Nothing here needs a server that answers.
"""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from pgonce import fingerprint
from pgonce.contrib.sqlalchemy import (
    NotPsycopgSession,
    async_enqueue,
    async_once,
    enqueue,
    once,
    process_batch,
)
from pgonce.core.inbox import InboxEvent
from pgonce.errors import UsageError

FP = fingerprint("POST", "/orders", b"{}")
# Nothing listens on port 1: a driver that connected would fail with its own error instead.
NOWHERE = "127.0.0.1:1/none"


def handle(event: InboxEvent, session: Session) -> None:
    raise AssertionError("no batch runs")


def test_a_sync_session_on_asyncpg_is_refused_with_the_scheme_to_use() -> None:
    engine = create_engine(f"postgresql+asyncpg://u@{NOWHERE}")
    with Session(engine) as session:
        with (
            pytest.raises(NotPsycopgSession, match=r"postgresql\+asyncpg.*postgresql\+psycopg://"),
            once(session, "t", "k", FP),
        ):
            pytest.fail("the block ran")
        with pytest.raises(NotPsycopgSession):
            enqueue(session, "order", "k", "order.created", {})
    with pytest.raises(NotPsycopgSession):
        process_batch(engine, "shop", handle)


def test_a_sync_session_on_the_async_psycopg_dialect_is_told_what_to_change() -> None:
    engine = create_engine(f"postgresql+psycopg_async://u@{NOWHERE}")
    with Session(engine) as session:
        with (
            pytest.raises(UsageError, match=r"async engine.*postgresql\+psycopg://"),
            once(session, "t", "k", FP),
        ):
            pytest.fail("the block ran")
        with pytest.raises(UsageError, match="async_enqueue"):
            enqueue(session, "order", "k", "order.created", {})
    with pytest.raises(UsageError, match="inbox_handler"):
        process_batch(engine, "shop", handle)


async def test_an_asyncpg_session_is_refused_before_it_connects() -> None:
    engine = create_async_engine(f"postgresql+asyncpg://u@{NOWHERE}")
    try:
        async with AsyncSession(engine) as session:
            with pytest.raises(NotPsycopgSession, match=r"postgresql\+asyncpg"):
                async with async_once(session, "t", "k", FP):
                    pytest.fail("the block ran")
            with pytest.raises(NotPsycopgSession):
                await async_enqueue(session, "order", "k", "order.created", {})
    finally:
        await engine.dispose()


def test_a_session_bound_to_no_engine_is_told_to_bind_one() -> None:
    with (
        Session() as session,
        pytest.raises(UsageError, match=r"bound to no engine.*Session\(engine\)"),
        once(session, "t", "k", FP),
    ):
        pytest.fail("the block ran")
