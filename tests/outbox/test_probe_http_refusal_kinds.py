"""The webhook publisher names the kind of each refusal (a 5xx answer, a row HTTP cannot carry, a
timeout, ...), so the relay counts each under its own reason and logs each kind of an aggregate
type on its own line. Every refusal used to be "refused": a row that can never be sent was
counted with a receiver's outage, and its line held back behind the outage's for a minute."""

from __future__ import annotations

import logging
from datetime import timedelta

import psycopg
import pytest

from pgonce.publishers.http import HttpPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.conftest import Receiver, free_port

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


async def test_each_kind_of_refusal_is_counted_and_logged_on_its_own(
    dsn: str, receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.status = lambda _n: 503
    down = f"http://127.0.0.1:{free_port()}/hooks"
    with psycopg.connect(dsn) as producer:
        enqueue(producer, "order", "1", "created", {"n": 1})
        enqueue(producer, "order", "2", "created", {"n": 2}, headers={"Content-Length": "1"})
        enqueue(producer, "order", "3", "created", {"n": 3})
        producer.commit()

    def route(message: object) -> str:
        return down if getattr(message, "aggregateid", "") == "3" else receiver.url

    publisher = HttpPublisher(secret=SECRET, routing=route, timeout=timedelta(seconds=5))
    relay = Relay(dsn, publisher, listen=False)
    caplog.set_level(logging.WARNING, logger="pgonce.relay")
    conn = await relay.connect(dsn)
    try:
        report = await relay.run_once(conn)
    finally:
        await conn.close()
        await publisher.close()
    assert report.refused == 3
    assert relay.stats.failures == {"http_5xx": 1, "unsendable": 1, "unreachable": 1}
    lines = [r.getMessage() for r in caplog.records if r.name == "pgonce.relay"]
    assert any("answered 503" in m for m in lines), lines
    assert any("'Content-Length'" in m for m in lines), lines
    assert any("ConnectError" in m for m in lines), lines
