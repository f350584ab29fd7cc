"""Engines on the test's own database, with the ``orders`` table of :mod:`.models`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

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
