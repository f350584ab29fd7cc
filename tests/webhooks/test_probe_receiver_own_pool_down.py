"""A receiver with a pool of its own (``dsn=``) whose database is down answers a delivery 503
with Retry-After within a provider's own timeout (GitHub's is 10 s), not after psycopg_pool's
default 30 s, by which time the provider has cut the request and counts a failure. The server
runs without lifespan events, as an app that mounts the receiver does: its first request opens
the pool."""

from __future__ import annotations

import json
import socket
import time

import httpx

from pgonce.webhooks.receiver import OWN_POOL_TIMEOUT, InboxReceiver
from tests.inbox.conftest import SCHEMA, hmac_scheme, serve, source


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_database_that_is_down_is_answered_503_within_a_providers_timeout() -> None:
    dsn = f"postgresql://postgres@127.0.0.1:{closed_port()}/nowhere?connect_timeout=2"
    receiver = InboxReceiver([source()], dsn=dsn, schema=SCHEMA)
    body = json.dumps({"type": "order.paid"}).encode()
    headers = hmac_scheme().sign(body, event_id="evt_down")
    with serve(receiver, lifespan="off") as url:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            started = time.monotonic()
            answer = await client.post("/webhooks/shop", content=body, headers=headers)
            waited = time.monotonic() - started
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"].isdigit()
    assert answer.headers["content-type"] == "application/problem+json"
    assert waited < OWN_POOL_TIMEOUT.total_seconds() + 4 < 10
