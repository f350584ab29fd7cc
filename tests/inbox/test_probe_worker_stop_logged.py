"""A stop that cuts a batch still running after ``shutdown_timeout`` says so, once, with what
happens to its events; before, the handler was cancelled and its batch rolled back without a
word, so a deploy that kept cutting a slow handler left no trace of it."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, effects, eventually, record_effect, source
from tests.inbox.test_worker import deliver, delivery, row


async def test_a_stop_that_cancels_a_batch_logs_it_once(
    effects_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "pgonce")
    await deliver(effects_dsn, delivery("e1", {}))
    started = asyncio.Event()

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        await record_effect(event, conn)
        started.set()
        await asyncio.Event().wait()  # never returns

    worker = InboxWorker(
        [source(handler=handler, handler_timeout=timedelta(hours=1))],
        dsn=effects_dsn,
        schema=SCHEMA,
        concurrency=2,
        shutdown_timeout=timedelta(milliseconds=200),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(started.wait(), 10)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert effects(effects_dsn) == []
    pending = await row(effects_dsn, "e1")
    assert (pending["status"], pending["attempts"]) == ("pending", 0)
    said = [r for r in caplog.records if "shutdown timeout" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert said[0].levelno == logging.WARNING
    message = said[0].getMessage()
    for words in ("1 batch", "0.2 s", "rolled back", "run again"):
        assert words in message


async def test_a_stop_that_waits_for_its_batches_says_nothing(
    effects_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "pgonce")
    await deliver(effects_dsn, delivery("e1", {}))
    worker = InboxWorker([source()], dsn=effects_dsn, schema=SCHEMA, concurrency=2)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await eventually(lambda: bool(effects(effects_dsn)), within=10)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert not [r for r in caplog.records if "shutdown timeout" in r.getMessage()]
