"""SIGTERM while a delivery waits longer than the stop allows (its table locked): the delivery is
cut when the stop's bound runs out, and its sender is answered 503 with Retry-After (its retry is
stored once, or answered as a duplicate), not uvicorn's bare 500 with a stack in the log."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest

from tests.service.test_serve import SCHEME, Service, start

CONFIG = """
[server]
log_format = "json"
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:TEST_SHOP_SECRET"]
"""


@pytest.fixture
def service(direct_dsn: str, tmp_path: Path) -> Iterator[Service]:
    running = start(direct_dsn, tmp_path, CONFIG)
    try:
        yield running
    finally:
        if running.process.poll() is None:
            running.stop()


def _waits_on_lock(conn: psycopg.Connection[tuple[int]]) -> bool:
    # The delivery's own statement: the service's sweeper and workers meet the same lock at
    # start, and one of them waiting there is no delivery in flight.
    row = conn.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE NOT l.granted AND a.datname = current_database()"
        " AND a.query LIKE '%inbox_store(%'"
    ).fetchone()
    return row is not None and row[0] > 0


async def delivery_at_the_lock(
    client: httpx.AsyncClient,
    service: Service,
    look: psycopg.Connection[tuple[int]],
    body: bytes,
    headers: dict[str, str],
) -> asyncio.Task[httpx.Response]:
    """The delivery, sent and waiting on the inbox's lock (held by the caller)."""
    answer = asyncio.create_task(
        client.post(service.url + "/webhooks/shop", content=body, headers=headers)
    )
    deadline = time.monotonic() + 30
    while not _waits_on_lock(look):
        assert time.monotonic() < deadline, "the delivery never reached the lock"
        await asyncio.sleep(0.05)
    return answer


def test_a_delivery_cut_by_the_stop_is_answered_503(direct_dsn: str, service: Service) -> None:
    body = json.dumps({"type": "order.paid", "data": {"order": "o1"}}).encode()
    headers = SCHEME.sign(body, event_id="evt_stop_cut")
    with psycopg.connect(direct_dsn) as lock, psycopg.connect(direct_dsn, autocommit=True) as look:
        lock.execute("LOCK TABLE pgonce.inbox IN ACCESS EXCLUSIVE MODE")

        async def deliver_then_stop() -> httpx.Response:
            async with httpx.AsyncClient(timeout=90) as client:
                answer = await delivery_at_the_lock(client, service, look, body, headers)
                service.process.send_signal(signal.SIGTERM)
                return await answer

        answer = asyncio.run(deliver_then_stop())
        lock.rollback()
    assert answer.status_code == 503, (answer.status_code, answer.text)
    assert answer.headers["retry-after"]
    assert answer.headers["content-type"] == "application/problem+json"
    assert service.process.wait(timeout=60) == 0
    log = service.log.read_text()
    assert "Exception in ASGI application" not in log
