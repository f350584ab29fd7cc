"""A handler that catches the stop's cancellation and carries on cannot hold the stop for ever:
after ``shutdown_timeout`` and a short grace, its connection is closed (its batch rolls back on
the server, its event stays pending) and ``run()`` returns, saying so once."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent
from pgonce.webhooks import worker as worker_module
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, effects, record_effect, source
from tests.inbox.test_worker import deliver, delivery, row


async def test_a_handler_that_ignores_the_stop_does_not_hold_it(
    effects_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "pgonce")
    await deliver(effects_dsn, delivery("e1", {}))
    started = asyncio.Event()
    release = asyncio.Event()

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        await record_effect(event, conn)
        started.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # ignores every cancellation

    worker = InboxWorker(
        [source(handler=handler, handler_timeout=timedelta(hours=2))],
        dsn=effects_dsn,
        schema=SCHEMA,
        concurrency=1,
        shutdown_timeout=timedelta(milliseconds=200),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(started.wait(), 10)
    stop.set()
    try:
        await asyncio.wait_for(
            asyncio.shield(task), 0.2 + worker_module.IGNORED_CANCEL_GRACE.total_seconds() + 5
        )
    finally:
        release.set()
    # The handler's write rolled back with its batch; the event waits for the next worker.
    assert effects(effects_dsn) == []
    pending = await row(effects_dsn, "e1")
    assert (pending["status"], pending["attempts"]) == ("pending", 0)
    said = [r for r in caplog.records if "ignored" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    message = said[0].getMessage()
    assert said[0].levelno == logging.WARNING
    for words in ("shop event e1", "CancelledError", "rolled back", "pending"):
        assert words in message, message
    await asyncio.sleep(0)
