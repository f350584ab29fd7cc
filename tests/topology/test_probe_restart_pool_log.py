"""The service's pool across a restart of PostgreSQL: its failed reconnections are one warning
when the outage starts (saying what happens meanwhile), one line when the pool connects again,
and debug lines in between, not two warnings a second from psycopg_pool for as long as it lasts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from pgonce.service.config import PoolConfig
from pgonce.service.pools import request_pool
from tests.inbox.test_probe_worker_outage_logged_once import BIN, _Server
from tests.topology.cluster import _free_port  # a port of the system's choosing, per worker

pytestmark = pytest.mark.skipif(
    not (BIN / "pg_ctl").exists(), reason="needs PostgreSQL 15's initdb and pg_ctl"
)


@pytest.fixture
def server() -> Iterator[_Server]:
    folder = Path(tempfile.mkdtemp(prefix="pgonce-restart-", dir="/tmp"))
    running = _Server(folder, _free_port())
    try:
        running.run(str(BIN / "initdb"), "-D", str(running.data), "-U", "postgres", "-A", "trust")
        running.start()
        yield running
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            running.crash()
        shutil.rmtree(folder, ignore_errors=True)


async def _select_one(pool: AsyncConnectionPool[Any]) -> None:
    async with pool.connection() as conn:
        await conn.execute("SELECT 1")


def _attempts(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The lines about a failed connect of the pool, at any level."""
    return [r for r in caplog.records if "connecting" in r.getMessage()]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_an_outage_is_one_warning_when_it_starts_and_one_line_when_it_ends(
    server: _Server, caplog: pytest.LogCaptureFixture
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
