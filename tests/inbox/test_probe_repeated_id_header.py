"""A delivery whose id header arrives twice with one value (a proxy that repeats it) is the same
event as the delivery with the header once: never a second event, nor a second effect."""

from __future__ import annotations

import json

import httpx
import psycopg
import pytest

from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from tests.inbox.conftest import SCHEMA, SECRET, record_effect, serve


@pytest.mark.parametrize(
    ("scheme", "id_header"),
    [("github", "x-github-delivery"), ("shopify", "x-shopify-webhook-id")],
)
def test_an_id_header_repeated_with_its_value_is_one_event(
    dsn: str, scheme: str, id_header: str
) -> None:
    signing = build_scheme(scheme, [SECRET])
    receiver = InboxReceiver(
        [Source(name="shop", scheme=signing, handler=record_effect)], dsn=dsn, schema=SCHEMA
    )
    body = json.dumps({"action": "paid", "order": 7}).encode()
    headers = signing.sign(body, event_id="delivery-7")
    doubled = [*headers.items(), (id_header, headers[id_header])]
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        once = client.post("/webhooks/shop", content=body, headers=headers)
        twice = client.post("/webhooks/shop", content=body, headers=doubled)
    assert (once.status_code, once.json()["outcome"]) == (200, "stored")
    assert (twice.status_code, twice.json()["outcome"]) == (200, "duplicate"), twice.text
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT event_id FROM {SCHEMA}.inbox").fetchall()
    assert rows == [("delivery-7",)]
