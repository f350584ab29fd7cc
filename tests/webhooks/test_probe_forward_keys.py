"""Forwarding an event whose id cannot be an Idempotency-Key as it is: a delivery is taken with
any event id of up to 512 bytes of text, and an id beyond ASCII made every forward fail with a
``UnicodeEncodeError`` before anything was sent (an id too long for a key was refused by the
target), retry after retry, until the event was dead-lettered, never forwarded. It is forwarded
under a key derived from it, the same at every retry. Through real servers: the receiver and
the target both under uvicorn, the worker on the test database."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import httpx
import psycopg
import pytest

from pgonce.webhooks.forward import forward_to
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.source import Source
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, hmac_scheme, serve


def recording_target(keys: list[str]) -> Callable[..., Any]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        keys.extend(
            value.decode("latin-1")
            for name, value in scope["headers"]
            if name == b"idempotency-key"
        )
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return app


@pytest.mark.parametrize(
    ("sent_id", "stored_id"),
    [
        # Header bytes beyond ASCII: the receiver reads them as Latin-1, as they were sent.
        ("\u00e9vt_1".encode("latin-1"), "\u00e9vt_1"),
        (b"e" * 300, "e" * 300),
        (b'"quoted', '"quoted'),
    ],
    ids=["latin-1", "too-long", "leading-quote"],
)
async def test_an_event_whose_id_is_no_key_is_forwarded_under_a_derived_one(
    dsn: str, sent_id: bytes, stored_id: str
) -> None:
    keys: list[str] = []
    with serve(recording_target(keys)) as target:
        shop = Source(name="shop", scheme=hmac_scheme(), handler=forward_to(f"{target}/events"))
        body = b'{"type": "order.paid"}'
        signed = hmac_scheme().sign(body)
        receiver = InboxReceiver([shop], dsn=dsn, schema=SCHEMA)
        with serve(receiver) as url:
            headers = [*signed.items(), ("x-event-id", sent_id)]
            async with httpx.AsyncClient(base_url=url) as client:
                answer = await client.post(
                    "/webhooks/shop",
                    content=body,
                    headers=headers,  # type: ignore[arg-type]
                )
        assert answer.status_code == 200, answer.text
        worker = InboxWorker([shop], dsn=dsn, schema=SCHEMA)
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            result = await worker.run_once(conn)
            again = await conn.execute(f"SELECT event_id, status FROM {SCHEMA}.inbox")
            rows = await again.fetchall()
    assert rows == [(stored_id, "done")]
    assert result.done == 1
    derived = "pgonce-sha256:" + hashlib.sha256(stored_id.encode()).hexdigest()
    assert keys == [derived]


async def test_an_event_whose_id_is_a_key_is_forwarded_under_it(dsn: str) -> None:
    keys: list[str] = []
    with serve(recording_target(keys)) as target:
        shop = Source(name="shop", scheme=hmac_scheme(), handler=forward_to(f"{target}/events"))
        body = b'{"type": "order.paid"}'
        receiver = InboxReceiver([shop], dsn=dsn, schema=SCHEMA)
        with serve(receiver) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                answer = await client.post(
                    "/webhooks/shop", content=body, headers=hmac_scheme().sign(body, event_id="e 1")
                )
        assert answer.status_code == 200, answer.text
        worker = InboxWorker([shop], dsn=dsn, schema=SCHEMA)
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            assert (await worker.run_once(conn)).done == 1
    assert keys == ["e 1"]
