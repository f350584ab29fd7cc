"""A failing handler is reported as it fails: with the event, the handler's error and what
happens next (retry at ..., dead-lettered), once per (source, reason) until the interval has
passed, and counted by reason for /metrics."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent, RetryPolicy
from pgonce.service.metrics import ServiceMetrics
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source
from tests.inbox.test_worker import deliver, delivery

T0 = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


async def run_all(
    worker: InboxWorker, conn: psycopg.AsyncConnection[Any], now: datetime, *, dead: bool = False
) -> int:
    """Batches at ``now`` until none is due; the events retried (or dead-lettered)."""
    count = 0
    while (result := await worker.run_once(conn, now=now, jitter=0.5)).claimed:
        count += result.dead if dead else result.retried
    return count


async def test_failures_are_logged_once_per_reason_with_the_next_step_and_counted(
    effects_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    await deliver(effects_dsn, *(delivery(f"e{i}", {"n": i}) for i in range(3)), now=T0)

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        raise LookupError(f"no customer for order {event.id}")

    metrics = ServiceMetrics()
    policy = RetryPolicy(attempts=2, base=timedelta(seconds=10), cap=timedelta(seconds=10))
    worker = InboxWorker(
        [source(handler=handler, retry=policy)],
        dsn=effects_dsn,
        schema=SCHEMA,
        on_failure=metrics.record_handler_failure,
    )
    caplog.set_level(logging.INFO, logger="pgonce.inbox")
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        assert await run_all(worker, conn, T0) == 3
        failed = [r.getMessage() for r in caplog.records if "handler of shop" in r.getMessage()]
        assert len(failed) == 1, failed
        assert "failed: LookupError: no customer for order e" in failed[0]
        assert "attempt 1, retry at 2030-01-01 12:00:07Z" in failed[0]

        caplog.clear()
        later = T0 + timedelta(minutes=2)
        assert await run_all(worker, conn, later, dead=True) == 3
        dead = [r for r in caplog.records if "handler of shop" in r.getMessage()]
        assert len(dead) == 1
        assert dead[0].levelno == logging.ERROR
        assert "dead-lettered after 2 attempts" in dead[0].getMessage()
        assert "`pgonce replay --source shop --event-id e" in dead[0].getMessage()

    text = metrics.render().decode()
    assert 'pgonce_inbox_handler_failures_total{reason="LookupError",source="shop"} 6.0' in text
