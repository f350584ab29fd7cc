"""A ``Source.event_id_fallback`` that returns something other than a str (an int, a dict) had
each delivery answered 400, a clear problem to the sender, but nothing in the application's log:
the team never learnt its own function was wrong while the provider retried for ever. It is now
logged once per source, naming the source, what the function returned and what happens next;
a retry storm does not flood the log. Through a real uvicorn server and the test database."""

from __future__ import annotations

import logging

import httpx
import psycopg
import pytest

from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from tests.inbox.conftest import SCHEMA, SECRET, serve


def test_a_fallback_that_returns_no_text_is_logged_once_per_source(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    # No id option: every delivery's id comes from the fallback.
    scheme = build_scheme("generic-hmac", [SECRET], options={"header": "x-signature"})
    sources = [
        Source(name="shop", scheme=scheme, event_id_fallback=lambda h, b: 12345),  # type: ignore[arg-type,return-value]
        Source(name="crm", scheme=scheme, event_id_fallback=lambda h, b: {"id": "x"}),  # type: ignore[arg-type,return-value]
        Source(name="good", scheme=scheme),
    ]
    receiver = InboxReceiver(sources, dsn=dsn, schema=SCHEMA)
    body = b'{"n": 1}'
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        with caplog.at_level(logging.WARNING, logger="pgonce.inbox"):
            refused = [
                client.post(f"/webhooks/{name}", content=body, headers=scheme.sign(body))
                for name in ("shop", "shop", "shop", "crm", "crm")
            ]
        stored = client.post("/webhooks/good", content=body, headers=scheme.sign(body))
    assert [a.status_code for a in refused] == [400] * 5, [a.text for a in refused]
    assert all(a.headers["content-type"] == "application/problem+json" for a in refused)
    logged = [r for r in caplog.records if r.name == "pgonce.inbox"]
    assert len(logged) == 2, [r.getMessage() for r in logged]
    shop, crm = (r.getMessage() for r in logged)
    assert "source shop" in shop
    assert "event_id_fallback" in shop
    assert "an int," in shop
    assert "400" in shop  # what happens next
    assert "source crm" in crm
    assert "a dict," in crm
    assert "'x'" not in crm  # the value itself, payload data, is not logged
    assert (stored.status_code, stored.json()["outcome"]) == (200, "stored")
    with psycopg.connect(dsn) as conn:
        count = conn.execute(f"SELECT count(*) FROM {SCHEMA}.inbox").fetchone()
    assert count == (1,)
