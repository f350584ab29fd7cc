"""A handler that ends the transaction its sync batch runs in, on a real database: nothing is
marked done that did not commit with its handler's writes, and nothing runs twice."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent
from pgonce.store._sync.inbox import InboxStore
from pgonce.webhooks.batch import run_batch
from tests.inbox.conftest import SCHEMA, effects, statuses
from tests.inbox.test_worker import T0, deliver, delivery, row


def batch(dsn: str, handle: Any, now: Any = T0) -> int:
    with psycopg.connect(dsn) as conn:

        @contextmanager
        def savepoint() -> Iterator[psycopg.Connection[Any]]:
            with conn.transaction(savepoint_name="event"):
                yield conn

        with conn.transaction():
            return run_batch(
                conn, "shop", handle, savepoint, store=InboxStore(schema=SCHEMA), now=now
            )


def record(event: InboxEvent, conn: psycopg.Connection[Any]) -> None:
    conn.execute("INSERT INTO effects (source, event_id) VALUES (%s, %s)", (event.source, event.id))


def ran(dsn: str) -> list[str]:
    return sorted(e for _, e, _ in effects(dsn))


@pytest.mark.parametrize("then_raise", [False, True])
async def test_a_batch_handler_that_commits_is_dead_lettered_and_the_rest_reopened(
    effects_dsn: str, then_raise: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The COMMIT commits the claim's done marks of the whole batch: the committing handler's
    event is dead-lettered (a rerun would repeat what it committed), the events whose handlers
    had not run are pending again, not done unrun nor run outside the batch's transaction."""
    await deliver(effects_dsn, *(delivery(f"e{i}", {"n": i}) for i in range(4)), now=T0)

    def handle(event: InboxEvent, conn: psycopg.Connection[Any]) -> None:
        record(event, conn)
        if event.id == "e1":
            conn.execute("COMMIT")
            if then_raise:
                raise RuntimeError("the handler's own error")

    with caplog.at_level(logging.ERROR, logger="pgonce.inbox"):
        assert batch(effects_dsn, handle) == 4
    assert statuses(effects_dsn) == {"e0": "done", "e1": "dead", "e2": "pending", "e3": "pending"}
    assert ran(effects_dsn) == ["e0", "e1"]
    assert (await row(effects_dsn, "e1"))["last_error"].startswith("HandlerEndedTransaction")
    assert "ran COMMIT on its batch's transaction" in caplog.text
    assert "the 2 after it are pending again" in caplog.text

    assert batch(effects_dsn, record) == 2
    assert ran(effects_dsn) == ["e0", "e1", "e2", "e3"]
    assert statuses(effects_dsn)["e1"] == "dead"


@pytest.mark.parametrize("then_raise", [False, True])
@pytest.mark.parametrize("statement", ["ROLLBACK", "RELEASE SAVEPOINT event"])
async def test_a_batch_handler_that_rolls_back_or_releases_its_savepoint_is_retried(
    effects_dsn: str, statement: str, then_raise: bool
) -> None:
    """A ROLLBACK undoes the whole batch; so does a RELEASE of the handler's savepoint, whose end
    then fails and aborts the batch's transaction. Every event is pending again, the handler's
    event with its failure counted (not a batch that fails again and again without one), and
    the next batch runs each event once."""
    await deliver(effects_dsn, *(delivery(f"e{i}", {"n": i}) for i in range(3)), now=T0)

    def handle(event: InboxEvent, conn: psycopg.Connection[Any]) -> None:
        record(event, conn)
        if event.id == "e1":
            conn.execute(statement)
            if then_raise:
                raise RuntimeError("the handler's own error")

    assert batch(effects_dsn, handle) == 3
    assert set(statuses(effects_dsn).values()) == {"pending"}
    assert ran(effects_dsn) == []
    failed = await row(effects_dsn, "e1")
    assert failed["attempts"] == 1
    assert failed["last_error"].startswith("HandlerEndedTransaction")
    assert ("the handler's own error" in failed["last_error"]) == then_raise

    assert batch(effects_dsn, record, now=T0 + timedelta(hours=1)) == 3
    assert ran(effects_dsn) == ["e0", "e1", "e2"]
    assert set(statuses(effects_dsn).values()) == {"done"}
