"""SIGTERM while a delivery waits on a lock (its table locked by another session): the stop waits
for the delivery in flight rather than cutting it, and the delivery's own lock bound
(``STORE_LOCK_TIMEOUT``, 5 s, well within the stop's bound of 30 s) answers it 503 with
Retry-After, as not stored (``unavailable``), not uvicorn's bare 500 with a stack in the log; the
service then exits cleanly. A delivery the stop does cut (a second signal, or the end of the
stop's bound) is answered 503 and named ``stopping``: see test_probe_stopping_outcome.py, which
shares this module's delivery at the lock (:func:`delivered_during_stop`)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
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


def signed(event_id: str) -> tuple[bytes, dict[str, str]]:
    """The body and signed headers of a delivery of event ``event_id``: the same at every
    sending, as a provider's retry is."""
    body = json.dumps({"type": "order.paid", "data": {"order": event_id}}).encode()
    return body, SCHEME.sign(body, event_id=event_id)


def delivered_during_stop(
    dsn: str, service: Service, event_id: str, stop: Callable[[], Awaitable[None]]
) -> httpx.Response:
    """The answer to a delivery of event ``event_id`` sent while the inbox's table is locked
    by another session; ``stop()`` runs once the delivery waits on that lock."""
    body, headers = signed(event_id)
    with psycopg.connect(dsn) as lock, psycopg.connect(dsn, autocommit=True) as look:
        lock.execute("LOCK TABLE pgonce.inbox IN ACCESS EXCLUSIVE MODE")

        async def deliver() -> httpx.Response:
            async with httpx.AsyncClient(timeout=90) as client:
                answer = await delivery_at_the_lock(client, service, look, body, headers)
                await stop()
                return await answer

        answer = asyncio.run(deliver())
        lock.rollback()
    return answer


def test_a_stop_waits_for_a_delivery_its_lock_bound_answers_503(
    direct_dsn: str, service: Service
) -> None:
    async def stop() -> None:
        service.process.send_signal(signal.SIGTERM)

    answer = delivered_during_stop(direct_dsn, service, "evt_stop_cut", stop)
    assert answer.status_code == 503, (answer.status_code, answer.text)
    assert answer.headers["retry-after"]
    assert answer.headers["content-type"] == "application/problem+json"
    # Answered by the delivery's lock bound, not cut by the stop.
    assert "could not be stored" in answer.json()["detail"], answer.text
    assert service.process.wait(timeout=60) == 0
    log = service.log.read_text()
    assert "Exception in ASGI application" not in log
    assert "cut by the stop" not in log, log
