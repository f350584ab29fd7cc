"""A handler that catches the cancellation of its handler_timeout and returns has not finished in
time: its event fails with HandlerTimeout and its writes roll back (it was cut at an arbitrary
await; the writes it made before were committed and the event marked done). The same for the
worker's stop: tests/inbox/test_worker.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import timedelta
from typing import Any

import psycopg

from pgonce.core.inbox import Delivery, InboxEvent, digest
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, effects, record_effect, source, statuses


async def deliver(dsn: str, *event_ids: str) -> None:
    body = json.dumps({}).encode()
    deliveries = [
        Delivery("shop", i, body, {"content-type": "application/json"}, digest(body), None)
        for i in event_ids
    ]
    async with await psycopg.AsyncConnection.connect(dsn) as conn, conn.transaction():
        await AsyncInboxStore(schema=SCHEMA).store(conn, deliveries)


async def last_error(dsn: str, event_id: str) -> str:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        found = await AsyncInboxStore(schema=SCHEMA).get(conn, "shop", event_id)
    assert found is not None
    return str(found["last_error"])


async def test_a_handler_that_swallows_its_deadline_fails_and_commits_nothing(
    effects_dsn: str,
) -> None:
    await deliver(effects_dsn, "cut")
    cut_short: list[str] = []

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        await record_effect(event, conn)
        try:
            await asyncio.sleep(30)  # the second half of its work never happens
        except asyncio.CancelledError:
            cut_short.append(event.id)  # and it returns as if it had finished

    worker = InboxWorker(
        [source(handler=handler, handler_timeout=timedelta(milliseconds=200))],
        dsn=effects_dsn,
        schema=SCHEMA,
    )
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        result = await worker.run_once(conn)
    assert cut_short == ["cut"]
    assert (result.claimed, result.retried) == (1, 1)
    assert effects(effects_dsn) == []
    assert statuses(effects_dsn) == {"cut": "pending"}
    assert (await last_error(effects_dsn, "cut")).startswith(
        "HandlerTimeout: the handler did not finish within 0.2 s"
    )


async def test_the_other_events_of_the_batch_commit_once(effects_dsn: str) -> None:
    await deliver(effects_dsn, "a", "cut", "b")

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        await record_effect(event, conn)
        if event.id == "cut":
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(30)

    worker = InboxWorker(
        [source(handler=handler, handler_timeout=timedelta(milliseconds=200))],
        dsn=effects_dsn,
        schema=SCHEMA,
    )
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        while (await worker.run_once(conn)).claimed:
            pass
    assert sorted(e[1] for e in effects(effects_dsn)) == ["a", "b"]
    assert statuses(effects_dsn) == {"a": "done", "b": "done", "cut": "pending"}


async def test_a_handler_within_its_deadline_is_done(effects_dsn: str) -> None:
    await deliver(effects_dsn, "quick")
    worker = InboxWorker(
        [source(handler_timeout=timedelta(seconds=5))], dsn=effects_dsn, schema=SCHEMA
    )
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        assert (await worker.run_once(conn)).claimed == 1
    assert statuses(effects_dsn) == {"quick": "done"}
    assert [e[1] for e in effects(effects_dsn)] == ["quick"]
