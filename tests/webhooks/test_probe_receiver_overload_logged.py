"""A receiver whose pool cannot serve every delivery (more concurrent deliveries than
connections) answers each refused one 503 with Retry-After, and logs the refusal once a minute
per source and cause, saying how many were held back: not a line per refused delivery, a flood
under exactly the load where the log matters."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import MutableMapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pgonce.webhooks import receiver as receiver_module
from pgonce.webhooks.receiver import InboxReceiver
from tests.inbox.conftest import SCHEMA, hmac_scheme, source


async def post(receiver: InboxReceiver, n: int) -> tuple[int, dict[str, str]]:
    """One signed delivery, through the ASGI app in this event loop: its status and headers."""
    body = json.dumps({"type": "order.paid", "order": n}).encode()
    headers = hmac_scheme().sign(body, event_id=f"evt_{n}")
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/webhooks/shop",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    sent = False
    answer: dict[str, Any] = {}

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            await asyncio.Event().wait()  # the client stays until answered
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
            answer["headers"] = {k.decode(): v.decode() for k, v in message["headers"]}

    await receiver(scope, receive, send)
    return answer["status"], answer["headers"]


async def test_refusals_of_an_exhausted_pool_are_logged_once_a_minute(
    dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pgonce.inbox")
    monkeypatch.setattr(receiver_module, "OWN_POOL_TIMEOUT", timedelta(milliseconds=200))
    now = [datetime.now(UTC)]
    monkeypatch.setattr(receiver_module, "_utcnow", lambda: now[0])
    receiver = InboxReceiver([source()], dsn=dsn, schema=SCHEMA, flushers=1, max_batch=1)
    async with receiver, receiver.pool.connection():  # its one connection, held
        answers = await asyncio.gather(*(post(receiver, n) for n in range(8)))
        answers += [await post(receiver, n) for n in range(8, 11)]
        now[0] += timedelta(minutes=1, seconds=1)
        answers.append(await post(receiver, 11))
    assert [status for status, _ in answers] == [503] * 12
    assert all(headers["retry-after"].isdigit() for _, headers in answers)
    lines = [r.getMessage() for r in caplog.records if r.name == "pgonce.inbox"]
    refused = [m for m in lines if "could not be stored" in m or "storing a delivery" in m]
    assert len(refused) == 2, lines
    assert "shop" in refused[0]
    assert "couldn't get a connection" in refused[0], refused[0]
    assert "(10 more like it since the last report)" in refused[1], refused[1]
