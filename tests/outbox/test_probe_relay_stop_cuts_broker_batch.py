"""A stop that cuts a batch at the broker (a webhook endpoint that accepts the connection and
never answers) says that: a batch at the broker was cut and its rows stay pending, sent again by
the next relay; not that database statements did not finish, which sends the operator looking
for a lock or a stalled server."""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
from datetime import timedelta

import psycopg
import pytest

from pgonce.publishers.http import HttpPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.conftest import wait_until


async def test_a_stop_that_cuts_a_batch_at_the_broker_says_so(
    direct_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pgonce.relay")
    with psycopg.connect(direct_dsn, autocommit=True) as conn, conn.transaction():
        enqueue(conn, "order", "1", "created", {"n": 1})
    # Accepts connections (the kernel's backlog) and never answers.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    port = silent.getsockname()[1]
    publisher = HttpPublisher(
        secret="whsec_" + base64.b64encode(b"0" * 32).decode(),
        url=f"http://127.0.0.1:{port}/hooks",
        timeout=timedelta(seconds=60),
    )
    relay = Relay(direct_dsn, publisher, concurrency=1, listen=False)
    relay.stop_grace = timedelta(milliseconds=200)
    stop = asyncio.Event()
    running = asyncio.create_task(relay.run(stop))
    try:
        await wait_until(lambda: any(doing == "settling" for doing, _ in relay._doing.values()))
    finally:
        stop.set()
        await asyncio.wait_for(running, 15)
        silent.close()
    lines = [r.getMessage() for r in caplog.records if "stopping without waiting" in r.getMessage()]
    (line,) = lines
    assert "database" not in line, line
    assert "lock" not in line, line
    assert "1 batch(es) at the broker" in line, line
    assert "pending" in line, line
    assert "next relay" in line, line
