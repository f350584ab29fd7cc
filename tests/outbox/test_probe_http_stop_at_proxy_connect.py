"""A relay asked to stop while the webhook publisher waits for its proxy's answer to CONNECT (an
https endpoint reached through ``HTTPS_PROXY``) stops at once: nothing of the row went out, only
the request for a tunnel to the endpoint.

httpx reports the CONNECT to the proxy with the same trace as a request, and the publisher took
its headers for the row's first bytes: the relay counted the batch as at the endpoint and gave it
the whole stop grace (10 s) to be answered. Now the CONNECT is no row's sending, and the batch is
"connecting" until the request itself goes out through the tunnel. Nothing is lost either way: the
row stays unpublished, with no attempt counted.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import psycopg
import pytest

from pgonce.publishers.http import HttpPublisher
from pgonce.relay import Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.stops import listening, running
from tests.outbox.test_probe_http_stop_at_connect import BOUND, SECRET, row_state


async def test_a_stop_while_the_proxy_holds_the_connect_ends_the_relay_at_once(
    direct_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(direct_dsn) as conn:
        row_id = enqueue(conn, "order", "1", "created", {"n": 1})
    asked = asyncio.Event()
    held: list[asyncio.StreamWriter] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A proxy that reads the CONNECT and never answers it (one whose upstream stalls)."""
        held.append(writer)
        request = await reader.readuntil(b"\r\n\r\n")
        assert request.startswith(b"CONNECT example.invalid:443 "), request
        asked.set()

    async with listening(proxy, held) as port:
        for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "https_proxy"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
        publisher = HttpPublisher(
            secret=SECRET, url="https://example.invalid/hook", timeout=timedelta(seconds=60)
        )
        relay = Relay(direct_dsn, publisher, listen=False, concurrency=1)
        # Far above the bound: a stop that counts the batch as at the endpoint waits it out.
        relay.stop_grace = timedelta(seconds=30)
        try:
            async with running(relay) as run:
                await asyncio.wait_for(asked.wait(), 30)
                await run.stop_within(
                    BOUND, "the relay took the proxy's CONNECT for the row's sending"
                )
        finally:
            await publisher.close()
    assert row_state(direct_dsn, row_id) == (False, 0)
