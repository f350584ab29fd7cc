"""A handler's exception that cannot be turned into text, on a real database."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, effects, eventually, record_effect, source, statuses
from tests.inbox.test_worker import deliver, delivery, row


class Unprintable(Exception):
    """As some libraries' exceptions are once unpickled: ``__str__`` reads what is not there."""

    def __str__(self) -> str:
        return f"status {self.status}"  # type: ignore[attr-defined]


async def test_an_exception_that_cannot_be_printed_fails_its_event_not_the_worker(
    effects_dsn: str,
) -> None:
    """Describing it for last_error and the log raised again, out of the batch: the worker's loop
    ended, and with it ``run`` and every other source's events."""
    await deliver(effects_dsn, delivery("bad", {}), delivery("good", {}))

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        if event.id == "bad":
            raise Unprintable()
        await record_effect(event, conn)

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA, concurrency=1)
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))
    await eventually(lambda: running.done() or statuses(effects_dsn).get("good") == "done", 15)
    stop.set()
    await running
    assert [e for _, e, _ in effects(effects_dsn)] == ["good"]
    failed = await row(effects_dsn, "bad")
    assert (failed["status"], failed["attempts"]) == ("pending", 1)
    assert failed["last_error"].startswith("Unprintable")
