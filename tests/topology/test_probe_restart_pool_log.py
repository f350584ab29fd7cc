"""The service's pool across a restart of PostgreSQL: its failed reconnections are one warning
when the outage starts (saying what happens meanwhile), one line when the pool connects again,
and debug lines in between, not two warnings a second from psycopg_pool for as long as it lasts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from pgonce.service.config import PoolConfig
from pgonce.service.pools import request_pool
from tests.throwaway import Server, needs_pg_ctl, throwaway_server

pytestmark = needs_pg_ctl


@pytest.fixture
def server() -> Iterator[Server]:
    with throwaway_server("pgonce-restart-", migrated=False) as running:
        yield running


async def _select_one(pool: AsyncConnectionPool[Any]) -> None:
    async with pool.connection() as conn:
        await conn.execute("SELECT 1")


def _attempts(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The lines about a failed connect of the pool, at any level."""
    return [r for r in caplog.records if "connecting" in r.getMessage()]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_an_outage_is_one_warning_when_it_starts_and_one_line_when_it_ends(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="psycopg.pool")
    caplog.set_level(logging.DEBUG, logger="pgonce.service")  # the last sets caplog's own level
    settings = PoolConfig(min_size=1, max_size=2, wait=timedelta(milliseconds=300))
    async with request_pool(server.dsn, settings, {"connect_timeout": 2}) as pool:
        await pool.wait()
        await asyncio.to_thread(server.crash)
        # Requests meanwhile fail within the pool's wait, and make the pool try to connect.
        async with asyncio.timeout(60):
            while len(_attempts(caplog)) < 3:
                with pytest.raises((PoolTimeout, psycopg.OperationalError)):
                    await _select_one(pool)
        during = _warnings(caplog)
        await asyncio.to_thread(server.start)
        async with asyncio.timeout(30):
            while True:
                with contextlib.suppress(PoolTimeout, psycopg.OperationalError):
                    await _select_one(pool)
                    break
    # psycopg_pool's own line for each attempt (and each time it gives up) is not written...
    each = [r.getMessage() for r in during if "'pgonce-service'" in r.getMessage()]
    assert each == [], each
    # ...but one line saying what failed and what happens meanwhile.
    connecting = [r.getMessage() for r in during if r.name == "pgonce.service"]
    assert len(connecting) == 1, connecting
    assert "Connection refused" in connecting[0], connecting
    assert "503" in connecting[0], connecting
    back = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(back) == 1, back
    assert "again after" in back[0], back
    # The pool stopped listening to psycopg_pool once closed: nothing is left behind.
    assert not logging.getLogger("psycopg.pool").filters
