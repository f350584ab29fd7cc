"""A handler that raises SystemExit (a sys.exit() in it, or in a library it calls, such as an
argparse parser) stops the worker as it asks, and its run is counted as a failed attempt first.
Before, the batch rolled back without a word and the attempt was not counted: every restart of
the worker ran the handler again and exited again, for ever, with nothing in the log."""

from __future__ import annotations

import sys
from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent, RetryPolicy
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, effects, record_effect, source, statuses
from tests.inbox.test_worker import T0, deliver, delivery, row


async def exits(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
    await record_effect(event, conn)
    if event.id == "exits":
        sys.exit(3)


async def test_a_handler_that_exits_counts_its_attempt_and_stops_the_worker(
    effects_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    await deliver(effects_dsn, delivery("first", {}), delivery("exits", {}), now=T0)
    worker = InboxWorker([source(handler=exits)], dsn=effects_dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        with pytest.raises(SystemExit) as raised:
            await worker.run_once(conn, now=T0, jitter=0.0)
    assert raised.value.code == 3
    assert effects(effects_dsn) == []  # the batch rolled back
    failed = await row(effects_dsn, "exits")
    assert (failed["status"], failed["attempts"]) == ("pending", 1)
    assert failed["last_error"] == "SystemExit: 3"
    assert failed["next_attempt_at"] > T0
    assert (await row(effects_dsn, "first"))["attempts"] == 0
    assert any("SystemExit" in r.getMessage() for r in caplog.records)


async def test_a_handler_that_exits_at_its_last_attempt_is_dead_lettered(effects_dsn: str) -> None:
    await deliver(effects_dsn, delivery("exits", {}), now=T0)
    worker = InboxWorker(
        [source(handler=exits, retry=RetryPolicy(attempts=1))], dsn=effects_dsn, schema=SCHEMA
    )
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        with pytest.raises(SystemExit):
            await worker.run_once(conn, now=T0, jitter=0.0)
        assert (await worker.run_once(conn, now=T0)).claimed == 0
    assert statuses(effects_dsn) == {"exits": "dead"}
