"""`pgonce_webhook_deliveries_total` counts what the receiver did with each delivery, as it names
it: a stale or future timestamp is `rejected_timestamp` (clock drift), not `rejected_signature`
(a wrong secret); Slack's url_verification handshake is `handshake`, not `stored` (nothing is
stored); a GET is `bad_method`. The metric's help text lists every outcome the receiver names."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator, MutableMapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, get_args

import httpx
import psycopg
import pytest

from pgonce.service.metrics import ServiceMetrics
from pgonce.webhooks.receiver import InboxReceiver, Outcome
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from tests.service.test_app_probes import serving
from tests.service.test_serve import SECRET, Service, metric

CONFIG = """
[server]
log_format = "json"
[sources.shop]
scheme = "standard-webhooks"
secrets = ["env:TEST_SHOP_SECRET"]
[sources.slack]
scheme = "slack"
secrets = ["env:TEST_SHOP_SECRET"]
"""
SHOP = build_scheme("standard-webhooks", [SECRET])
SLACK = build_scheme("slack", [SECRET])
DELIVERIES = "pgonce_webhook_deliveries_total"


@pytest.fixture
def service(direct_dsn: str, tmp_path: Path) -> Iterator[Service]:
    with serving(direct_dsn, tmp_path, CONFIG) as running:
        yield running


def shop(client: httpx.Client, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return client.post("/webhooks/shop", content=body, headers=headers)


def test_each_outcome_is_counted_as_the_receiver_names_it(
    direct_dsn: str, service: Service
) -> None:
    body = b'{"type": "order.created"}'
    now = datetime.now(UTC)
    with httpx.Client(base_url=service.url, timeout=30) as client:
        stale = SHOP.sign(body, event_id="stale-1", timestamp=now - timedelta(hours=1))
        future = SHOP.sign(body, event_id="future-1", timestamp=now + timedelta(hours=1))
        for headers in (stale, future):
            answer = shop(client, body, headers)
            assert answer.status_code == 401
            assert answer.json()["title"] == "Webhook timestamp out of tolerance"

        wrong = build_scheme("standard-webhooks", ["whsec_" + "A" * 43]).sign(
            body, event_id="wrong-1"
        )
        answer = shop(client, body, wrong)
        assert (answer.status_code, answer.json()["title"]) == (401, "Invalid webhook signature")

        assert client.get("/webhooks/shop").status_code == 405

        signed = SHOP.sign(body, event_id="evt-1")
        assert shop(client, body, signed).json() == {"outcome": "stored"}
        assert shop(client, body, signed).json() == {"outcome": "duplicate"}

        challenge = json.dumps({"type": "url_verification", "challenge": "abc"}).encode()
        answer = client.post("/webhooks/slack", content=challenge, headers=SLACK.sign(challenge))
        assert (answer.status_code, answer.json()) == (200, {"challenge": "abc"})

    with psycopg.connect(direct_dsn) as conn:
        stored = conn.execute("SELECT source, event_id FROM pgonce.inbox").fetchall()
    assert stored == [("shop", "evt-1")]  # the handshake is no event

    counted = {
        (labels["source"], labels["outcome"]): value
        for labels, value in samples(service.url, DELIVERIES)
    }
    assert counted == {
        ("shop", "rejected_timestamp"): 2,
        ("shop", "rejected_signature"): 1,
        ("shop", "bad_method"): 1,
        ("shop", "stored"): 1,
        ("shop", "duplicate"): 1,
        ("slack", "handshake"): 1,
    }
    assert metric(service.url, DELIVERIES, source="slack", outcome="stored") == 0


def samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    found = []
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1 :].rsplit("} ", 1)
            found.append((dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value)))
    return found


def test_the_help_text_lists_exactly_the_outcomes_the_receiver_names() -> None:
    help_text = ServiceMetrics().deliveries._documentation
    listed = re.search(r"outcome \(([^)]*)\)", help_text)
    assert listed is not None, help_text
    # The service names two more, answers the receiver never gave: "error" (a 500) and
    # "stopping" (a delivery the service's stop cut, answered 503).
    assert set(listed.group(1).split(", ")) == {*get_args(Outcome), "error", "stopping"}


def test_a_sender_gone_before_its_body_is_read_is_disconnected_and_not_answered(
    direct_dsn: str,
) -> None:
    receiver = InboxReceiver([Source("shop", SHOP)], dsn=direct_dsn)
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/webhooks/shop", "headers": []}
    assert asyncio.run(receiver.respond(scope, receive, send)) == "disconnected"
    assert sent == []
