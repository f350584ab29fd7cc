"""An async worker's handler that ends the savepoint the worker isolates it in (the batches
that follow a failure), on a real database: its event's failure is recorded and the batch's
other events run again, rather than every batch failing without a trace."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, effects, record_effect, source, statuses
from tests.inbox.test_worker import T0, deliver, delivery, row


@pytest.mark.parametrize("then_raise", [False, True])
async def test_a_handler_that_releases_the_workers_savepoint_fails_its_event(
    effects_dsn: str, then_raise: bool
) -> None:
    await deliver(effects_dsn, delivery("first", {}), now=T0)
    failed_once = released = False

    async def handler(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        nonlocal failed_once, released
        if event.id == "first" and not failed_once:
            failed_once = True
            raise RuntimeError("a failure, after which batches use savepoints")
        await record_effect(event, conn)
        if event.id == "e1" and not released:
            released = True
            await conn.execute("RELEASE SAVEPOINT pgonce_inbox_event")
            if then_raise:
                raise RuntimeError("the handler's own error")

    worker = InboxWorker([source(handler=handler)], dsn=effects_dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        assert (await worker.run_once(conn, now=T0)).retried == 1
        await deliver(effects_dsn, *(delivery(f"e{i}", {"n": i}) for i in range(3)), now=T0)
        result = await worker.run_once(conn, now=T0)
        assert (result.claimed, result.done, result.retried) == (3, 0, 1)
        assert effects(effects_dsn) == []
        assert statuses(effects_dsn) == {
            "first": "pending",
            "e0": "pending",
            "e1": "pending",
            "e2": "pending",
        }
        failed = await row(effects_dsn, "e1")
        assert failed["attempts"] == 1
        assert failed["last_error"].startswith("HandlerEndedTransaction")
        later = T0 + timedelta(hours=1)
        while (await worker.run_once(conn, now=later)).claimed:
            pass
    assert sorted(e for _, e, _ in effects(effects_dsn)) == ["e0", "e1", "e2", "first"]
    assert set(statuses(effects_dsn).values()) == {"done"}
