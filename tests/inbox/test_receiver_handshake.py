"""A provider's handshake (Slack's url_verification) through a real server: answered after its
signature is verified and before anything written for events looks at it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pgonce.core.inbox import Ordering
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from tests.inbox.conftest import SCHEMA, serve

SECRET = "slack-signing-secret"


def by_channel(payload: Any, headers: Any) -> Ordering:
    """An application's extractor, written for events (a handshake has no "event")."""
    return Ordering(payload["event"]["channel"])


def id_of_events(headers: Any, body: bytes) -> str:
    raise KeyError("event")


@pytest.mark.parametrize(
    "options",
    [{"ordering": by_channel}, {"event_id_fallback": id_of_events}],
    ids=["ordering", "event_id_fallback"],
)
def test_a_slack_handshake_is_answered_before_the_events_extractors_run(
    dsn: str, options: dict[str, Any]
) -> None:
    scheme = build_scheme("slack", [SECRET])
    handshake = json.dumps({"token": "t", "challenge": "c-123", "type": "url_verification"})
    event = json.dumps({"type": "event_callback", "event_id": "Ev1", "event": {"channel": "C1"}})
    forged = build_scheme("slack", ["another-secret"]).sign(handshake.encode())
    receiver = InboxReceiver(
        [Source(name="slack", scheme=scheme, **options)], dsn=dsn, schema=SCHEMA
    )
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        answered = client.post(
            "/webhooks/slack", content=handshake, headers=scheme.sign(handshake.encode())
        )
        stored = client.post("/webhooks/slack", content=event, headers=scheme.sign(event.encode()))
        refused = client.post("/webhooks/slack", content=handshake, headers=forged)
    assert (answered.status_code, answered.json()) == (200, {"challenge": "c-123"})
    assert (stored.status_code, stored.json()) == (200, {"outcome": "stored"})
    assert refused.status_code == 401
    assert "c-123" not in refused.text
