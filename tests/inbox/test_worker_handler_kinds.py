"""Handlers that are not what the worker expects, on a real database."""

from __future__ import annotations

from typing import Any

import psycopg

from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source
from tests.inbox.test_worker import deliver, delivery, row


async def test_a_handler_that_is_not_async_is_dead_lettered_at_once_not_run_again(
    effects_dsn: str,
) -> None:
    """A plain ``def`` handler runs to its end (its effects outside the database happen) and
    then cannot be awaited. It was retried as a failure, so its effects were repeated at every
    attempt, ten times by default."""
    await deliver(effects_dsn, delivery("e1", {}), delivery("e2", {}))
    calls: list[str] = []

    def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        calls.append(event.id)  # an e-mail sent, a payment captured...

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        for _ in range(12):
            await worker.run_once(conn, jitter=0.0)
            async with conn.transaction():
                await conn.execute(
                    f"UPDATE {SCHEMA}.inbox SET next_attempt_at = now() WHERE status = 'pending'"
                )
    assert sorted(calls) == ["e1", "e2"]
    for event_id in ("e1", "e2"):
        found = await row(effects_dsn, event_id)
        assert (found["status"], found["attempts"]) == ("dead", 1)
        assert found["last_error"].startswith("HandlerNotAsync: the handler of source 'shop'")
        assert "async def" in found["last_error"]
