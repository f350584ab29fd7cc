"""A two-phase call whose database restarts while the third party answers: the heartbeat's
connection is gone for good (a psycopg connection does not reconnect), so the heartbeat says so
once and stops, instead of announcing further tries and failing every beat until the call
returns; the call then raises DatabaseUnavailable and records nothing."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest

from pgonce.errors import DatabaseUnavailable
from pgonce.store._async.phases import AsyncPhaseStore
from pgonce.store._sync.phases import PhaseStore
from tests.throwaway import Server, needs_pg_ctl, throwaway_server

pytestmark = needs_pg_ctl

BEAT = timedelta(milliseconds=50)


@pytest.fixture
def server() -> Iterator[Server]:
    with throwaway_server("pgonce-restart-") as running:
        yield running


def _heartbeat_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pgonce.phases"]


async def test_a_heartbeat_whose_connection_is_gone_says_so_once_and_stops(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pgonce.phases")
    store = AsyncPhaseStore(lease=timedelta(seconds=30), heartbeat=BEAT)
    conn = await psycopg.AsyncConnection.connect(server.dsn, autocommit=True)
    try:
        op = await store.start(conn, "shop", "order-1", b"\x01" * 32)
        assert op.won

        async def charge(key: str) -> dict[str, str]:
            await asyncio.to_thread(server.crash)
            await asyncio.to_thread(server.start)  # back, but the holder's connection is not
            # Several beats' time: the heartbeat either stopped at the first, or failed at each.
            async with asyncio.timeout(30):
                while len(_heartbeat_lines(caplog)) < 4 and not conn.closed:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            await asyncio.sleep(BEAT.total_seconds() * 4)
            return {"charge": "ch_1"}

        with pytest.raises(DatabaseUnavailable):
            await op.call("charge", charge)
    finally:
        await conn.close()
    lines = _heartbeat_lines(caplog)
    assert len(lines) == 1, [r.getMessage() for r in lines]
    (line,) = lines
    assert line.levelno == logging.WARNING
    message = line.getMessage()
    assert "stops" in message, message
    assert "tries again" not in message, message


def test_the_thread_heartbeat_whose_connection_is_gone_says_so_once_and_stops(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pgonce.phases")
    store = PhaseStore(lease=timedelta(seconds=30), heartbeat=BEAT)
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        op = store.start(conn, "shop", "order-2", b"\x02" * 32)
        assert op.won
        gone = threading.Event()

        def charge(key: str) -> dict[str, str]:
            server.crash()
            server.start()
            # Several beats' time: the heartbeat either stopped at the first, or failed at each.
            deadline = time.monotonic() + 30
            while not conn.closed and time.monotonic() < deadline:
                gone.wait(0.02)
            gone.wait(BEAT.total_seconds() * 4)
            return {"charge": "ch_2"}

        with pytest.raises(DatabaseUnavailable):
            op.call("charge", charge)
    lines = _heartbeat_lines(caplog)
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert "stops" in lines[0].getMessage(), lines[0].getMessage()
