"""A retry policy of many attempts with a long base delay, on a real database."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg

from pgonce.core.inbox import InboxEvent, RetryPolicy
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source
from tests.inbox.test_worker import T0, deliver, delivery, row

#: About 25 days of retries, at most six hours apart.
LONG = RetryPolicy(attempts=100, base=timedelta(hours=1), cap=timedelta(hours=6))


async def test_a_late_attempt_of_a_long_policy_is_retried_at_the_cap(effects_dsn: str) -> None:
    """``base * 2 ** (attempts - 1)`` overflowed timedelta from the 36th failure on: the
    OverflowError left the batch, ended the worker, and did again at each restart."""
    await deliver(effects_dsn, delivery("e1", {}), now=T0)
    async with await psycopg.AsyncConnection.connect(effects_dsn, autocommit=True) as conn:
        await conn.execute(f"UPDATE {SCHEMA}.inbox SET attempts = 60")

    async def failing(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        raise RuntimeError("the ledger is down")

    worker = InboxWorker([source(handler=failing, retry=LONG)], dsn=effects_dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        result = await worker.run_once(conn, now=T0, jitter=0.5)
    assert result.retried == 1
    found = await row(effects_dsn, "e1")
    assert (found["status"], found["attempts"]) == ("pending", 61)
    assert found["next_attempt_at"] - T0 == timedelta(hours=4, minutes=30)  # 3 h + half of 3 h
