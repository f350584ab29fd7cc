"""A second SIGTERM or SIGINT while the stop waits for a request (uvicorn's line says "CTRL+C to
force quit") ends the wait: the request is cut and answered 503 with Retry-After at once,
instead of the signal being ignored for the rest of the stop's 30-second bound."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import httpx
import psycopg

from tests.service.test_probe_stop_cuts_delivery import (  # noqa: F401
    delivery_at_the_lock,
    service,
)
from tests.service.test_serve import SCHEME, Service

#: Well under the stop's own 30-second bound, which the first test of the cut waits out.
PROMPTLY = 15


def _said(log: Path, words: str, deadline: float) -> None:
    while words not in log.read_text():
        assert time.monotonic() < deadline, f"never said {words!r}:\n{log.read_text()}"
        time.sleep(0.05)


def test_a_second_signal_cuts_the_wait(direct_dsn: str, service: Service) -> None:  # noqa: F811
    body = json.dumps({"type": "order.paid", "data": {"order": "o2"}}).encode()
    headers = SCHEME.sign(body, event_id="evt_second_signal")
    with psycopg.connect(direct_dsn) as lock, psycopg.connect(direct_dsn, autocommit=True) as look:
        lock.execute("LOCK TABLE pgonce.inbox IN ACCESS EXCLUSIVE MODE")

        async def deliver_then_stop_twice() -> tuple[httpx.Response, float]:
            async with httpx.AsyncClient(timeout=90) as client:
                answer = await delivery_at_the_lock(client, service, look, body, headers)
                service.process.send_signal(signal.SIGTERM)
                await asyncio.to_thread(_said, service.log, "Waiting for", time.monotonic() + 30)
                second = time.monotonic()
                service.process.send_signal(signal.SIGINT)
                return await answer, time.monotonic() - second

        answer, took = asyncio.run(deliver_then_stop_twice())
        lock.rollback()
    assert answer.status_code == 503, (answer.status_code, answer.text)
    assert answer.headers["retry-after"]
    assert took < PROMPTLY, took
    assert service.process.wait(timeout=60) == 0
