"""The sync batch the ORM adapters share, given an async handler, on a real database."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent
from pgonce.errors import UsageError
from pgonce.store._sync.inbox import InboxStore
from pgonce.webhooks.batch import run_batch
from tests.inbox.conftest import SCHEMA
from tests.inbox.test_worker import deliver, delivery, row

ran: list[str] = []


async def async_handler(event: InboxEvent, conn: Any) -> None:
    ran.append(event.id)


def batch(dsn: str, handle: Any) -> int:
    with psycopg.connect(dsn) as conn:

        @contextmanager
        def savepoint() -> Iterator[None]:
            with conn.transaction():
                yield None

        with conn.transaction():
            return run_batch(conn, "shop", handle, savepoint, store=InboxStore(schema=SCHEMA))


async def test_an_async_handler_is_refused_before_anything_is_claimed(dsn: str) -> None:
    """Called and never awaited, it did nothing, and every event of the batch was marked done:
    lost without a trace."""
    await deliver(dsn, delivery("e1", {}), delivery("e2", {}))
    with pytest.raises(UsageError, match="async def"):
        batch(dsn, async_handler)
    assert ran == []
    assert {(await row(dsn, e))["status"] for e in ("e1", "e2")} == {"pending"}


async def test_a_handler_that_returns_an_awaitable_fails_its_event(dsn: str) -> None:
    """One that the check at the call cannot see (a lambda, a sync wrapper): its event fails and
    is retried, never marked done with its handler unrun."""
    await deliver(dsn, delivery("e1", {}))
    assert batch(dsn, lambda event, conn: async_handler(event, conn)) == 1
    found = await row(dsn, "e1")
    assert (found["status"], found["attempts"]) == ("pending", 1)
    assert "async def" in found["last_error"]
    assert ran == []
