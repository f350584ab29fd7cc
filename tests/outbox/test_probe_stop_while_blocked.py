"""A relay asked to stop while a batch's statement waits on the database stops promptly.

A stop used to wait for the statement for as long as it waited: a claim blocked on a lock another
session holds (a migration's ACCESS EXCLUSIVE, a VACUUM FULL), or the marking of a published batch
blocked the same way, held SIGTERM for good. Now a claim is cancelled at once (nothing of its batch
reached the broker), a batch at the broker gets the relay's stop grace to mark what was
acknowledged, then is cancelled; the rows wait for the next run, and one line says what was cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, Literal

import psycopg
import pytest

from pgonce.core.outbox import OutboxMessage
from pgonce.publishers.base import PublishResult
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.conftest import wait_until
from tests.stalling import freezing

#: Far above what a prompt stop takes, far below forever.
BOUND = 15


class Recording:
    """A publisher that acknowledges everything and remembers what it was given."""

    name = "recording"

    def __init__(self) -> None:
        self.published: list[str] = []

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        self.published.extend(str(m.message_id) for m in batch)
        return PublishResult(acked=frozenset(m.id for m in batch))

    async def close(self) -> None:
        pass


def blocked_on_lock(dsn: str, locker: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> %s AND %s = ANY(pg_blocking_pids(pid))",
            (locker, locker),
        ).fetchone()
    return bool(row and row[0])


def pending(dsn: str) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*), max(attempts) FROM pgonce.outbox WHERE published_at IS NULL"
        ).fetchone()


async def run_then_stop(relay: Relay, reached: Callable[[], Awaitable[object]]) -> None:
    """Run ``relay`` until ``reached()`` returns, ask it to stop, and fail unless it stops within
    BOUND seconds."""
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await reached()
    except BaseException:
        running.cancel()
        await asyncio.wait({running}, timeout=BOUND)
        raise
    stop.set()
    done, _ = await asyncio.wait({running}, timeout=BOUND)
    if running not in done:
        running.cancel()
        await asyncio.wait({running})
        pytest.fail("the relay did not stop while its statement waited on the database")
    running.result()


@contextlib.asynccontextmanager
async def locked(dsn: str, mode: Literal["ACCESS EXCLUSIVE", "SHARE"]) -> AsyncIterator[int]:
    """The outbox table locked in ``mode`` by a connection of its own until the block ends: yields
    that connection's backend pid."""
    async with await psycopg.AsyncConnection.connect(dsn) as locker:
        await locker.execute(f"LOCK TABLE pgonce.outbox IN {mode} MODE")
        yield locker.info.backend_pid
        await locker.rollback()


def enqueue_one(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        enqueue(conn, "order", "1", "created", {"n": 1})


async def next_run_publishes(dsn: str, publisher: Recording) -> None:
    """A relay run after the stop publishes what the stopped one left, and leaves nothing."""
    await Relay(dsn, publisher, listen=False).drain()
    assert pending(dsn) == (0, None)


@pytest.fixture(autouse=True)
def relay_lines(caplog: pytest.LogCaptureFixture) -> None:
    """Every test here reads the relay's INFO lines."""
    caplog.set_level(logging.INFO, logger="pgonce.relay")


def cut_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "pgonce.relay" and "stopping without waiting" in r.getMessage()
    ]


@pytest.mark.parametrize("listen", [False, True])
async def test_stop_cancels_a_claim_blocked_on_a_lock(
    direct_dsn: str, caplog: pytest.LogCaptureFixture, listen: bool
) -> None:
    enqueue_one(direct_dsn)
    publisher = Recording()
    async with locked(direct_dsn, "ACCESS EXCLUSIVE") as locker:
        relay = Relay(direct_dsn, publisher, listen=listen, concurrency=1)
        await run_then_stop(relay, lambda: wait_until(lambda: blocked_on_lock(direct_dsn, locker)))
    assert publisher.published == []
    (line,) = cut_lines(caplog)
    assert "claim(s) of a batch, not done within 1 s, before anything was published" in line
    assert "the rows of a cancelled batch wait for the next run" in line
    assert pending(direct_dsn) == (1, 0)
    # The next run publishes the row, once.
    await next_run_publishes(direct_dsn, publisher)
    assert len(publisher.published) == 1


async def test_stop_cuts_a_batch_whose_marking_is_blocked_after_the_grace(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    enqueue_one(direct_dsn)
    publisher = Recording()
    # SHARE lets the claim (FOR UPDATE) through and blocks the UPDATE that marks the rows.
    async with locked(direct_dsn, "SHARE") as locker:
        relay = Relay(direct_dsn, publisher, listen=False, concurrency=1)
        relay.stop_grace = timedelta(milliseconds=200)
        await run_then_stop(
            relay,
            lambda: wait_until(lambda: publisher.published and blocked_on_lock(direct_dsn, locker)),
        )
    (line,) = cut_lines(caplog)
    assert "1 batch(es) at the broker, not settled within 0.2 s" in line
    assert "their 1 rows were not marked" in line
    assert "same message ids" in line
    assert pending(direct_dsn) == (1, 0)
    # Published again by the next run, with the same message id: nothing lost.
    await next_run_publishes(direct_dsn, publisher)
    assert len(publisher.published) == 2
    assert len(set(publisher.published)) == 1


async def test_an_idle_relay_stops_without_a_line_about_cut_statements(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:

    def waiting() -> bool:
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pgonce.outbox_waiting_relays").fetchone()
        return bool(row and row[0])

    await run_then_stop(Relay(direct_dsn, Recording(), concurrency=1), lambda: wait_until(waiting))
    assert cut_lines(caplog) == []
    assert not waiting(), "the relay left its registration as a waiting relay behind"


async def test_stop_gives_up_a_claim_on_a_server_that_stopped_answering(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    enqueue_one(direct_dsn)
    publisher = Recording()
    # The claim's statement goes out and no answer ever comes back, on any connection.
    with freezing(direct_dsn, b"FOR UPDATE OF o SKIP LOCKED") as proxy:

        async def frozen() -> None:
            await asyncio.to_thread(proxy.frozen.wait, BOUND)
            assert proxy.frozen.is_set()

        relay = Relay(proxy.dsn(direct_dsn), publisher, listen=False, concurrency=1)
        await run_then_stop(relay, frozen)
    assert publisher.published == []
    (line,) = cut_lines(caplog)
    assert "claim(s) of a batch" in line
    assert pending(direct_dsn) == (1, 0)
