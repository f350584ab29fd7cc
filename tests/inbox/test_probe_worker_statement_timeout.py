"""An inbox worker whose batches a server-set statement_timeout cuts (``ALTER DATABASE ... SET
statement_timeout``) says so, once per run of failures: the statement was cut by the setting, where
it is likely set, and that the batch is retried with its events pending; not that the worker lost
the database, which sends the operator looking for an outage. Every cut batch is still counted."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.worker import InboxWorker
from tests.cutting import claims_cut_by_statement_timeout
from tests.inbox.conftest import source


async def _nothing(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
    return None


async def test_a_batch_cut_by_statement_timeout_is_reported_as_such_once(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pgonce.inbox")
    failures: list[Exception] = []
    enough = asyncio.Event()

    def on_connection_failure(connection: str, error: Exception) -> None:
        if connection == "worker":
            failures.append(error)
            if len(failures) >= 3:
                enough.set()

    worker = InboxWorker(
        [source(handler=_nothing)],
        dsn=direct_dsn,
        concurrency=1,
        listen=False,
        on_connection_failure=on_connection_failure,
    )
    with claims_cut_by_statement_timeout(direct_dsn, "pgonce.inbox", "300ms"):
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run(stop))
        try:
            async with asyncio.timeout(30):
                await enough.wait()
        finally:
            stop.set()
            await running

    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not any("lost the database" in m for m in loud), loud
    cut = [m for m in loud if "statement_timeout" in m]
    assert len(cut) == 1, loud
    assert "300ms" in cut[0], cut[0]
    for words in ("ALTER DATABASE", "ROLE", "retried", "pending"):
        assert words in cut[0], cut[0]
    assert len(failures) >= 3
