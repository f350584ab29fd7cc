"""A delivery cut by the stop (SIGTERM, the stop's bound run out or a second signal) is answered
503 with Retry-After and named ``stopping``, in its log line and in
``pgonce_webhook_deliveries_total``: not ``unavailable``, which says the database could not store
it, so an alert on that outcome does not fire for a routine deploy. The provider redelivers it."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
from psycopg_pool import AsyncConnectionPool

from pgonce.service.admin import Admin
from pgonce.service.app import ServiceApp
from pgonce.service.metrics import ServiceMetrics
from pgonce.store._async.health import AsyncHealthCheck
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.source import Source
from tests.service.test_probe_stop_cuts_delivery import (  # noqa: F401
    CONFIG,
    delivered_during_stop,
    service,
    signed,
)
from tests.service.test_serve import SCHEME, Service, start


def _said(log: Path, words: str, deadline: float) -> None:
    while words not in log.read_text():
        assert time.monotonic() < deadline, f"never said {words!r}:\n{log.read_text()}"
        time.sleep(0.05)


def _cut_lines(log: Path) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    return [line for line in lines if "cut by the stop" in line["message"]]


def test_a_delivery_cut_by_the_stop_is_logged_as_stopping(
    direct_dsn: str,
    service: Service,  # noqa: F811
    tmp_path: Path,
) -> None:
    async def stop_twice() -> None:
        service.process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(_said, service.log, "Waiting for", time.monotonic() + 30)
        # The second signal cuts the wait, as the end of the stop's bound does.
        service.process.send_signal(signal.SIGTERM)

    answer = delivered_during_stop(direct_dsn, service, "evt_stopping", stop_twice)
    assert service.process.wait(timeout=60) == 0
    assert answer.status_code == 503, (answer.status_code, answer.text)
    assert answer.headers["retry-after"]
    assert "the service stopped" in answer.json()["detail"]
    cut = _cut_lines(service.log)
    assert len(cut) == 1, service.log.read_text()
    assert cut[0]["outcome"] == "stopping"
    assert cut[0]["source"] == "shop"
    # Nothing is lost: the provider's retry, to the service started again, is acknowledged.
    body, headers = signed("evt_stopping")
    again = start(direct_dsn, tmp_path, CONFIG)
    try:
        retry = httpx.post(again.url + "/webhooks/shop", content=body, headers=headers, timeout=30)
    finally:
        again.stop()
    assert retry.status_code == 200, (retry.status_code, retry.text)


async def test_a_delivery_cut_by_the_stop_is_counted_as_stopping(direct_dsn: str) -> None:
    async with AsyncConnectionPool(direct_dsn, min_size=1, max_size=2, open=False) as pool:
        receiver = InboxReceiver([Source("shop", SCHEME)], pool=pool)
        metrics = ServiceMetrics()
        health = AsyncHealthCheck()
        admin = Admin(None, pool, schema="pgonce", health=health, stuck_after=lambda: None)
        app = ServiceApp(
            pool=pool,
            schema="pgonce",
            receiver=receiver,
            metrics=metrics,
            health=health,
            admin=admin,
        )
        body = b'{"type": "order.paid"}'
        headers = [
            (k.lower().encode(), v.encode())
            for k, v in SCHEME.sign(body, event_id="evt_counted").items()
        ]
        scope = {"type": "http", "method": "POST", "path": "/webhooks/shop", "headers": headers}
        reading = asyncio.Event()
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            # The body is on its way: the handler waits inside, as a slow sender makes it.
            reading.set()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async def send(message: Any) -> None:
            sent.append(dict(message))

        request = asyncio.ensure_future(app(scope, receive, send))
        await reading.wait()
        # What uvicorn does to the requests in flight at the end of the stop's bound.
        request.cancel()
        await asyncio.wait({request})
        await receiver.close()
    assert sent[0]["status"] == 503
    assert (b"retry-after", b"5") in sent[0]["headers"]
    counted = {(s, o): n for s, o, n in metrics.answered()}
    assert counted == {("shop", "stopping"): 1}, counted


def test_the_reference_describes_the_stopping_outcome() -> None:
    from tests.service.test_probe_metrics_reference_labels import generator

    assert "stopping: a 503 with Retry-After" in generator().metrics_reference()
