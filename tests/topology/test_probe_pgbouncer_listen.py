"""An inbox worker run as a library, whose LISTEN goes through PgBouncer in transaction mode,
notices that no notification reaches it, says so once, and polls without registering as waiting.

LISTEN runs through the pooler, and the server session that ran it goes back to the pool: nothing
it is notified of reaches the worker. The worker used to wait on that connection in silence (the
service says so at its start; an application running InboxWorker itself heard nothing), woken only
by its poll, while registering its loops as waiting at every sleep, so that every delivery stored
sent a NOTIFY (which serializes the commits of the deliveries) that no one received.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgonce.webhooks.worker import InboxWorker
from tests.conftest import SCHEMA
from tests.inbox.conftest import create_effects, effects, eventually, source
from tests.inbox.test_worker import deliver, delivery


def registrations(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {SCHEMA}.inbox_waiting_workers").fetchone()
    return int(row[0]) if row else 0


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "received no notification" in r.getMessage()]


async def test_a_worker_listening_through_a_transaction_pooler_says_so_and_polls(
    direct_dsn: str, pgbouncer_server_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgonce")
    pooled = make_conninfo(pgbouncer_server_dsn, dbname=conninfo_to_dict(direct_dsn)["dbname"])
    create_effects(direct_dsn)
    worker = InboxWorker(
        [source()],
        dsn=pooled,
        schema=SCHEMA,
        poll_interval=timedelta(milliseconds=200),
        connect_kwargs={"prepare_threshold": None},
    )
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        await eventually(lambda: bool(said(caplog)), within=30)
        # Polling goes on, with no loop registered as waiting for a notification.
        await eventually(lambda: registrations(direct_dsn) == 0, within=10)
        await deliver(pooled, delivery("e1", {}))
        await eventually(lambda: len(effects(direct_dsn)) == 1, within=10)
        assert registrations(direct_dsn) == 0
    finally:
        stop.set()
        await running
    (line,) = said(caplog)
    assert "poll every 0.2 s instead" in line
    assert "listen_dsn" in line
    assert "postgres@" not in line


async def test_a_worker_listening_directly_keeps_being_woken(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgonce")
    create_effects(direct_dsn)
    worker = InboxWorker(
        [source()],
        dsn=direct_dsn,
        schema=SCHEMA,
        poll_interval=timedelta(minutes=10),  # only a notification can wake it in time
    )
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        await eventually(lambda: registrations(direct_dsn) >= 1, within=10)
        await deliver(direct_dsn, delivery("e1", {}))
        await eventually(lambda: len(effects(direct_dsn)) == 1, within=10)
    finally:
        stop.set()
        await running
    assert not said(caplog)
