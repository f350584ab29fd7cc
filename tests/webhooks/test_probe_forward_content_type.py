"""Forwarding an event whose Content-Type holds a byte beyond ASCII (a charset or boundary
parameter in Latin-1, as some senders write it): the receiver keeps the header as the bytes that
were sent, read as Latin-1, and every forward failed with a ``UnicodeEncodeError`` before anything
was sent, retry after retry, until the event was dead-lettered, never forwarded. It is forwarded
with the Content-Type bytes it arrived with. Through real servers: the receiver and the target
both under uvicorn, the worker on the test database."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import psycopg

from pgonce.webhooks.forward import forward_to
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.source import Source
from pgonce.webhooks.worker import InboxWorker
from tests.inbox.conftest import SCHEMA, hmac_scheme, serve


def recording_target(types: list[bytes]) -> Callable[..., Any]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        types.extend(value for name, value in scope["headers"] if name == b"content-type")
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    return app


async def test_an_event_with_a_latin_1_content_type_is_forwarded_with_it(dsn: str) -> None:
    sent_type = "application/json; name=r\u00e9sum\u00e9".encode("latin-1")
    types: list[bytes] = []
    with serve(recording_target(types)) as target:
        shop = Source(name="shop", scheme=hmac_scheme(), handler=forward_to(f"{target}/events"))
        body = b'{"type": "order.paid"}'
        headers = [*hmac_scheme().sign(body, event_id="evt_1").items()]
        receiver = InboxReceiver([shop], dsn=dsn, schema=SCHEMA)
        with serve(receiver) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                answer = await client.post(
                    "/webhooks/shop",
                    content=body,
                    headers=[
                        *((k.encode(), v.encode()) for k, v in headers),
                        (b"content-type", sent_type),
                    ],
                )
        assert answer.status_code == 200, answer.text
        worker = InboxWorker([shop], dsn=dsn, schema=SCHEMA)
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            result = await worker.run_once(conn)
            found = await conn.execute(f"SELECT status, last_error FROM {SCHEMA}.inbox")
            rows = await found.fetchall()
    assert rows == [("done", None)]
    assert result.done == 1
    assert types == [sent_type]
