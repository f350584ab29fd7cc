"""Engines on the test's own database, with the ``orders`` table of :mod:`.models`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import psycopg
import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from tests.keys.helpers import sqlalchemy_url
from tests.sqlalchemy_adapter.models import Base


@pytest.fixture
def engine(dsn: str) -> Iterator[Engine]:
    engine = create_engine(sqlalchemy_url(dsn))
    Base.metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
async def async_engine(engine: Engine, dsn: str) -> AsyncIterator[AsyncEngine]:
    """An async engine on the same database (``engine`` made the tables)."""
    async_engine = create_async_engine(sqlalchemy_url(dsn))
    yield async_engine
    await async_engine.dispose()


@pytest.fixture
def other(engine: Engine, dsn: str) -> Iterator[Engine]:
    """A second engine on the same database (``engine`` made the tables)."""
    other = create_engine(sqlalchemy_url(dsn))
    yield other
    other.dispose()


@pytest.fixture
async def async_other(async_engine: AsyncEngine, dsn: str) -> AsyncIterator[AsyncEngine]:
    """A second async engine on the same database."""
    other = create_async_engine(sqlalchemy_url(dsn))
    yield other
    await other.dispose()


def stored(dsn: str) -> tuple[list[str], list[tuple[str, int | None]]]:
    """(the orders' keys, each stored key with its response status), as another connection
    sees them."""
    with psycopg.connect(dsn, autocommit=True) as c:
        orders = [r[0] for r in c.execute("SELECT key FROM orders ORDER BY key")]
        keys = [(r[0], r[1]) for r in c.execute("SELECT key, response_status FROM pgonce.keys")]
    return orders, keys
