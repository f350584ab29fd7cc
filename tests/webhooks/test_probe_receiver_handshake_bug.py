"""A scheme of the application's own whose ``handshake`` breaks on a verified delivery (a
``KeyError`` on a body it did not expect) was answered 500 with a traceback by the server: the
handshake was the one scheme call the receiver did not guard, while a failing ``verify`` or
``event_id`` is a problem response. It is now a 400 problem, logged once with the traceback, and
nothing is stored; other deliveries to the source go on. Through a real uvicorn server and the
test database."""

from __future__ import annotations

import json
import logging
from datetime import datetime

import httpx
import psycopg
import pytest

from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes.base import Headers
from pgonce.webhooks.source import Source
from tests.inbox.conftest import SCHEMA, SECRET, hmac_scheme, serve


class HandshakingScheme:
    """The test scheme, with a handshake that reads a field only handshakes carry."""

    name = "handshaking"

    def __init__(self) -> None:
        self.inner = hmac_scheme()
        self.header_names = self.inner.header_names

    def verify(self, headers: Headers, body: bytes, *, now: datetime) -> None:
        self.inner.verify(headers, body, now=now)

    def event_id(self, headers: Headers, body: bytes) -> str | None:
        return self.inner.event_id(headers, body)

    def handshake(self, body: bytes) -> bytes | None:
        document = json.loads(body)
        if document["kind"] != "hello":
            return None
        return b"{}"


def test_a_handshake_that_breaks_is_a_problem_not_a_500(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = InboxReceiver(
        [Source(name="shop", scheme=HandshakingScheme())], dsn=dsn, schema=SCHEMA
    )
    broken, event = b'{"no": "kind"}', b'{"kind": "order"}'
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        with caplog.at_level(logging.ERROR, logger="pgonce.inbox"):
            refused = client.post(
                "/webhooks/shop", content=broken, headers=hmac_scheme().sign(broken, event_id="e1")
            )
        stored = client.post(
            "/webhooks/shop", content=event, headers=hmac_scheme().sign(event, event_id="e2")
        )
    assert refused.status_code == 400, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["status"] == 400
    assert SECRET not in refused.text
    logged = [r for r in caplog.records if r.name == "pgonce.inbox"]
    assert len(logged) == 1
    assert logged[0].exc_info is not None
    assert "shop" in logged[0].getMessage()
    assert (stored.status_code, stored.json()["outcome"]) == (200, "stored")
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT event_id FROM {SCHEMA}.inbox").fetchall()
    assert rows == [("e2",)]


class TextHandshakingScheme(HandshakingScheme):
    """A handshake answered with text, not the bytes the protocol asks for."""

    def handshake(self, body: bytes) -> bytes | None:
        return '{"challenge": "c"}' if b"hello" in body else None  # type: ignore[return-value]


def test_a_handshake_answered_with_text_is_a_problem_not_a_500(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    receiver = InboxReceiver(
        [Source(name="shop", scheme=TextHandshakingScheme())], dsn=dsn, schema=SCHEMA
    )
    hello = b'{"kind": "hello"}'
    with (
        serve(receiver) as url,
        httpx.Client(base_url=url) as client,
        caplog.at_level(logging.ERROR, logger="pgonce.inbox"),
    ):
        refused = client.post(
            "/webhooks/shop", content=hello, headers=hmac_scheme().sign(hello, event_id="e1")
        )
    assert refused.status_code == 400, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert [r.name for r in caplog.records if r.name == "pgonce.inbox"] == ["pgonce.inbox"]
