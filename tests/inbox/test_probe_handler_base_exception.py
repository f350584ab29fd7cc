"""A handler that raises a BaseException that is neither a cancellation nor SystemExit (a
library's own, such as a test framework's outcome or a green-thread timeout) ended the worker
with nothing logged and its attempt not counted: the same event ended every restart of the
worker, for ever. It is now handled as SystemExit is: the worker stops as asked, after counting
the attempt and logging the event once, so that the event is dead-lettered in the end."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent, RetryPolicy
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, source
from tests.inbox.test_worker import deliver, delivery, row


class Abort(BaseException):
    """A library's BaseException."""


async def test_an_unusual_base_exception_is_counted_and_said(
    effects_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    kind = Abort
    caplog.set_level(logging.INFO, "pgonce")
    await deliver(effects_dsn, delivery("e1", {}))

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        raise kind("out")

    worker = InboxWorker(
        [source(handler=handler, retry=RetryPolicy(attempts=2))],
        dsn=effects_dsn,
        schema=SCHEMA,
        concurrency=1,
    )
    for attempt in (1, 2):
        with pytest.raises(kind):
            await asyncio.wait_for(worker.run(asyncio.Event()), 10)
        found = await row(effects_dsn, "e1")
        assert found["attempts"] == attempt
    # After the source's last attempt the event is dead, and no longer ends the worker.
    assert found["status"] == "dead"
    assert kind.__qualname__ in found["last_error"]
    stopped = f"shop event e1 raised {kind.__qualname__}: the worker stops as asked"
    said = [r for r in caplog.records if stopped in r.getMessage()]
    assert len(said) == 2, [r.getMessage() for r in caplog.records]
