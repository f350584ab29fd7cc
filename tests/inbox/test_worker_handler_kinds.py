"""Handlers that are not what the worker expects, on a real database."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent
from pgonce.errors import UsageError
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


async def test_replay_refuses_a_lone_event_id_rather_than_replaying_its_characters(
    effects_dsn: str,
) -> None:
    """``replay(conn, "shop", "ab")`` read "ab" as the ids "a" and "b": it replayed those dead
    letters, and not "ab"."""
    await deliver(effects_dsn, delivery("a", {}), delivery("b", {}), delivery("ab", {}))
    async with await psycopg.AsyncConnection.connect(effects_dsn, autocommit=True) as conn:
        await conn.execute(f"UPDATE {SCHEMA}.inbox SET status = 'dead', processed_at = now()")
    worker = InboxWorker([source()], dsn=effects_dsn, schema=SCHEMA)
    async with await psycopg.AsyncConnection.connect(effects_dsn) as conn:
        with pytest.raises(UsageError, match=r"for one, pass \['ab'\]"):
            await worker.replay(conn, "shop", "ab")
        assert await worker.replay(conn, "shop", ["ab"]) == ["ab"]
    assert [(await row(effects_dsn, e))["status"] for e in ("a", "b")] == ["dead", "dead"]
