"""A ``generic-hmac`` source whose ``id_field`` holds a JSON integer (``{"id": 12345}``, as
Shopify-like senders send) answered every delivery 400 "not a string", even with an ``id_header``
that would have supplied an id: the provider retried for ever and no event reached the
application. An integer id is now taken as its decimal text, as an integer ordering key is. A
float or a bool is still refused, and the header still serves only a body without the field (the
body's id is signed, the header is not). Through a real uvicorn server and the test database."""

from __future__ import annotations

import httpx
import psycopg
import pytest

from pgonce.errors import BadPayload
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from tests.inbox.conftest import SCHEMA, SECRET, serve


def _scheme(**options: str) -> object:
    return build_scheme(
        "generic-hmac", [SECRET], options={"header": "x-signature", "id_field": "id", **options}
    )


def _stored(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(f"SELECT event_id FROM {SCHEMA}.inbox ORDER BY event_id").fetchall()
    return [row[0] for row in rows]


@pytest.mark.parametrize("id_header", [None, "x-event-id"])
def test_an_integer_id_in_the_body_is_its_decimal_text(dsn: str, id_header: str | None) -> None:
    scheme = _scheme(**({"id_header": id_header} if id_header else {}))
    receiver = InboxReceiver([Source(name="shop", scheme=scheme)], dsn=dsn, schema=SCHEMA)  # type: ignore[arg-type]
    first, again = b'{"id": 12345, "n": 1}', b'{"id": 12345, "n": 1}'
    big = b'{"id": 820982911946154508}'
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        answers = [
            client.post("/webhooks/shop", content=body, headers=scheme.sign(body, event_id="h"))  # type: ignore[attr-defined]
            for body in (first, again, big)
        ]
    assert [(a.status_code, a.json().get("outcome")) for a in answers] == [
        (200, "stored"),
        (200, "duplicate"),
        (200, "stored"),
    ], [a.text for a in answers]
    assert _stored(dsn) == ["12345", "820982911946154508"]


@pytest.mark.parametrize("value", ["1.5", "1e3", "true", "[1]", '{"a": 1}'])
def test_an_id_that_is_no_integer_nor_string_is_still_refused(value: str) -> None:
    scheme = _scheme(id_header="x-event-id")
    body = b'{"id": %s}' % value.encode()
    with pytest.raises(BadPayload):
        scheme.event_id({"x-event-id": "from-header"}, body)  # type: ignore[attr-defined]


def test_the_header_serves_only_a_body_without_the_field() -> None:
    scheme = _scheme(id_header="x-event-id")
    assert scheme.event_id({"x-event-id": "h1"}, b'{"other": 1}') == "h1"  # type: ignore[attr-defined]
    assert scheme.event_id({"x-event-id": "h1"}, b'{"id": null}') == "h1"  # type: ignore[attr-defined]
    assert scheme.event_id({"x-event-id": "h1"}, b'{"id": 7}') == "7"  # type: ignore[attr-defined]
