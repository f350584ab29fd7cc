"""A handler that closes the connection the worker gave it, on a real database. The close rolls
the batch back; the transaction's end then did nothing, and the batch was reported done while
its event stayed pending with no attempt counted: every batch ran the handler again, forever,
each logged as a lost database. Its failure is now recorded (on a connection of its own), so the
event is retried with backoff and then dead-lettered, like any failing handler's."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent, RetryPolicy
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, effects, eventually, record_effect, source, statuses
from tests.inbox.test_worker import T0, deliver, delivery, row


@pytest.mark.parametrize("then_raise", [False, True])
async def test_a_handler_that_closes_its_connection_fails_its_event(
    effects_dsn: str, then_raise: bool
) -> None:
    await deliver(effects_dsn, delivery("first", {}), delivery("second", {}), now=T0)

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        await record_effect(event, conn)
        if event.id == "second":
            await conn.close()
            if then_raise:
                raise RuntimeError("and then it raised")

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        result = await worker.run_once(conn, now=T0, jitter=0.0)
    assert (result.claimed, result.done, result.retried) == (2, 0, 1)
    assert effects(effects_dsn) == []  # the close rolled the whole batch back
    assert statuses(effects_dsn) == {"first": "pending", "second": "pending"}
    failed = await row(effects_dsn, "second")
    assert failed["attempts"] == 1
    assert failed["last_error"].startswith("HandlerEndedTransaction")
    assert "closed the worker's connection" in failed["last_error"]
    assert (await row(effects_dsn, "first"))["attempts"] == 0


async def test_a_worker_whose_handler_closes_its_connection_dead_letters_the_event(
    effects_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "pgonce")
    await deliver(effects_dsn, delivery("e1", {}))
    runs = 0

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        nonlocal runs
        runs += 1
        await conn.close()

    worker = InboxWorker(
        [source(handler=handler, retry=RetryPolicy(attempts=1))],
        dsn=effects_dsn,
        schema=SCHEMA,
        concurrency=1,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    try:
        await eventually(lambda: statuses(effects_dsn) == {"e1": "dead"}, within=10)
    finally:
        stop.set()
        await running
    assert runs == 1
    assert "closed the worker's connection" in (await row(effects_dsn, "e1"))["last_error"]
    assert not [r for r in caplog.records if "lost the database" in r.getMessage()]


async def test_the_error_of_a_handler_that_closed_its_connection_says_it_once(
    effects_dsn: str,
) -> None:
    await deliver(effects_dsn, delivery("e1", {}), now=T0)

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.close()

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        await worker.run_once(conn, now=T0, jitter=0.0)
    error = (await row(effects_dsn, "e1"))["last_error"]
    assert error.count("closed the worker's connection") == 1
    assert "and then raised" not in error
