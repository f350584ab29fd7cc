"""A consumer's handler that ends handle()'s transaction itself (COMMIT or ROLLBACK in SQL) and
then raises: the error reaches the caller, saying what was committed, and the claim is settled
as the end left it (a COMMIT: completed, so a redelivery is a duplicate and the committed writes
do not run again; a ROLLBACK: nothing done, a redelivery runs the handler again)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

from pgonce.consumers import IdempotentConsumer, Outcome
from pgonce.errors import UsageError

Handler = Callable[[psycopg.AsyncConnection[Any]], Awaitable[None]]


class Boom(Exception):
    pass


@pytest.fixture
async def db(dsn: str) -> Any:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("CREATE TABLE effects (message_id text, step text)")
        yield conn


async def effects(conn: psycopg.AsyncConnection[Any]) -> list[str]:
    cur = await conn.execute("SELECT step FROM effects ORDER BY step")
    return [r[0] for r in await cur.fetchall()]


def end_then_raise(end: str, *, write_after: bool) -> Handler:
    async def handler(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects VALUES ('1', 'before')")
        await conn.execute(end)
        if write_after:
            await conn.execute("INSERT INTO effects VALUES ('1', 'after')")
        raise Boom("the handler's own failure")

    return handler


async def _again(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.execute("INSERT INTO effects VALUES ('1', 'again')")


@pytest.mark.parametrize("write_after", [False, True], ids=["raise", "write-then-raise"])
@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "autocommit-off"])
async def test_commit_then_raise_is_a_duplicate_and_says_so(
    dsn: str, db: psycopg.AsyncConnection[Any], write_after: bool, autocommit: bool
) -> None:
    consumer = IdempotentConsumer("shipping")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit) as conn:
        with pytest.raises(UsageError) as raised:
            await consumer.handle(
                conn, "1", b"{}", end_then_raise("COMMIT", write_after=write_after)
            )
        message = str(raised.value)
        assert isinstance(raised.value.__cause__, Boom)  # the handler's error reaches the caller
        assert "Boom" in message
        assert "the handler's own failure" in message
        assert "committed" in message
        assert "Outcome.DUPLICATE" in message
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        # What the COMMIT committed stays; what the handler wrote after it rolled back, unless
        # autocommit committed it statement by statement (which the error says).
        kept = ["after", "before"] if write_after and autocommit else ["before"]
        assert await effects(db) == kept
        assert ("autocommit" in message) == autocommit
        # The redelivery must not run the committed writes again, nor wait for the key to expire.
        assert await consumer.handle(conn, "1", b"{}", _again) == Outcome.DUPLICATE
        assert await effects(db) == kept
        if not autocommit:
            await conn.rollback()


@pytest.mark.parametrize("write_after", [False, True], ids=["raise", "write-then-raise"])
async def test_rollback_then_raise_runs_again(
    db: psycopg.AsyncConnection[Any], write_after: bool
) -> None:
    consumer = IdempotentConsumer("shipping")
    with pytest.raises(UsageError) as raised:
        await consumer.handle(db, "1", b"{}", end_then_raise("ROLLBACK", write_after=write_after))
    assert isinstance(raised.value.__cause__, Boom)
    assert "rolled back" in str(raised.value)
    assert "Boom" in str(raised.value)
    # The autocommit connection committed what the handler wrote after its ROLLBACK.
    kept = ["after"] if write_after else []
    assert await effects(db) == kept
    assert await consumer.handle(db, "1", b"{}", _again) == Outcome.PROCESSED
    assert await effects(db) == sorted([*kept, "again"])


@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "autocommit-off"])
async def test_a_plain_failure_goes_on_as_it_was_raised(
    dsn: str, db: psycopg.AsyncConnection[Any], autocommit: bool
) -> None:
    async def fails(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects VALUES ('1', 'before')")
        raise Boom("plain")

    consumer = IdempotentConsumer("shipping")
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=autocommit) as conn:
        with pytest.raises(Boom):
            await consumer.handle(conn, "1", b"{}", fails)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert await effects(db) == []
        assert await consumer.handle(conn, "1", b"{}", _again) == Outcome.PROCESSED
        assert await effects(db) == ["again"]
        if not autocommit:
            await conn.commit()


async def test_a_handler_that_swallows_the_cancellation_commits_nothing(
    db: psycopg.AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    started = asyncio.Event()

    async def swallows(conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("INSERT INTO effects VALUES ('1', 'before')")
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)

    consumer = IdempotentConsumer("shipping")
    task = asyncio.create_task(consumer.handle(db, "1", b"{}", swallows))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    # Cut at an arbitrary await: its writes and the claim rolled back, not PROCESSED.
    assert await effects(db) == []
    said = [r for r in caplog.records if "caught the cancellation" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelno == logging.WARNING
    assert "message 1" in said[0].getMessage()
    assert "rolled back" in said[0].getMessage()
    assert await consumer.handle(db, "1", b"{}", _again) == Outcome.PROCESSED
