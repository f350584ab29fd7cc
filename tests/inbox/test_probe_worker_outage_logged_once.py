"""An inbox worker whose database goes away says so once, with what it does meanwhile, once more
when it is back, and counts every failure in between (``pgonce_inbox_worker_failures``): not a
line a second from each loop and from LISTEN for as long as the outage lasts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from pgonce.core.inbox import InboxEvent
from pgonce.service.metrics import ServiceMetrics
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import source
from tests.throwaway import Server, needs_pg_ctl, throwaway_server

pytestmark = needs_pg_ctl


@pytest.fixture
def server() -> Iterator[Server]:
    with throwaway_server("pgonce-outage-") as running:
        yield running


async def _nothing(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
    return None


async def _until(condition: Any) -> None:
    """Wait until ``condition()`` holds: each check is cheap and local, and what it waits for
    (a failure counted, a line logged) has no event of its own to await."""
    async with asyncio.timeout(30):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.02)


async def test_an_outage_is_one_line_when_it_starts_one_when_it_ends_and_counted(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="pgonce.inbox")
    metrics = ServiceMetrics()
    failures: dict[str, int] = {"worker": 0, "listen": 0}

    def on_connection_failure(connection: str, error: Exception) -> None:
        failures[connection] += 1
        metrics.record_worker_failure(connection, error)

    worker = InboxWorker(
        [source(handler=_nothing)],
        dsn=server.dsn,
        concurrency=2,
        on_connection_failure=on_connection_failure,
    )
    stop = asyncio.Event()
    running = asyncio.create_task(worker.run(stop))

    async def listening() -> bool:
        async with await psycopg.AsyncConnection.connect(server.dsn, autocommit=True) as c:
            cur = await c.execute(
                "SELECT count(*) FILTER (WHERE query LIKE 'LISTEN%%'), count(*) "
                "FROM pg_stat_activity WHERE backend_type = 'client backend' "
                "AND pid <> pg_backend_pid()"
            )
            row = await cur.fetchone()
        assert row is not None
        return bool(row[0] >= 1 and row[1] >= 3)

    try:
        async with asyncio.timeout(30):
            while not await listening():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        server.crash()
        # Several failures of each connection: the outage lasts several reconnect delays.
        await _until(lambda: failures["worker"] >= 4 and failures["listen"] >= 3)
        server.start()
        await _until(
            lambda: (
                any("LISTEN connection is back" in r.getMessage() for r in caplog.records)
                and any("runs batches again after" in r.getMessage() for r in caplog.records)
            ),
        )
    finally:
        stop.set()
        await running

    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    lost = [m for m in loud if "inbox worker lost the database" in m]
    listen = [m for m in loud if "inbox LISTEN connection failed" in m]
    assert len(lost) == 1, loud
    assert "reconnects every 1 s" in lost[0]
    assert len(listen) == 1, loud
    assert "poll every 1 s" in listen[0]
    assert any("inbox worker runs batches again after" in m for m in loud), loud
    assert any("inbox LISTEN connection is back after" in m for m in loud), loud
    text = metrics.render().decode()
    counted = {
        connection: sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("pgonce_inbox_worker_failures_total{")
            and f'connection="{connection}"' in line
        )
        for connection in ("worker", "listen")
    }
    assert counted == {c: float(n) for c, n in failures.items()}
    assert counted["worker"] >= 4
    assert counted["listen"] >= 3
