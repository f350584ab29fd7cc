"""A scheme or an extractor of the application that raises on every delivery (a bug, or a
payload it was not written for) had a full traceback logged at each delivery, and providers retry
every refused delivery: the log filled with one traceback per retry. Each delivery is still
answered its problem (400, or 401 for a broken signature check), and the cause is logged once per
source, step and cause, with its traceback, the rest counted in the next report (a minute later).
Through a real uvicorn server and the test database."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from tests.inbox.conftest import SCHEMA, SECRET, serve

SCHEME = build_scheme("generic-hmac", [SECRET], options={"header": "x-signature"})


class BrokenScheme:
    """The generic scheme, with one of its steps broken."""

    def __init__(self, broken: str) -> None:
        self.name = SCHEME.name
        self.broken = broken

    def verify(self, headers: Any, body: bytes, *, now: Any) -> None:
        if self.broken == "verify":
            raise RuntimeError("verify is broken")
        SCHEME.verify(headers, body, now=now)

    def event_id(self, headers: Any, body: bytes) -> str | None:
        if self.broken == "event_id":
            raise KeyError("id")
        return None


def no_fallback(headers: Any, body: bytes) -> str:
    raise ValueError("the fallback is broken")


def no_ordering(payload: Any, headers: Any) -> Any:
    return payload["missing"]


def test_a_broken_extractor_is_logged_once_per_source(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    sources = [
        Source(name="verify", scheme=BrokenScheme("verify")),
        Source(name="ids", scheme=BrokenScheme("event_id")),
        Source(name="fallback", scheme=SCHEME, event_id_fallback=no_fallback),
        Source(name="ordered", scheme=SCHEME, ordering=no_ordering),
        Source(name="good", scheme=SCHEME),
    ]
    receiver = InboxReceiver(sources, dsn=dsn, schema=SCHEMA)
    body = b'{"n": 1}'
    names = ["verify", "ids", "fallback", "ordered"]
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        with caplog.at_level(logging.WARNING, logger="pgonce.inbox"):
            answers = {
                name: [
                    client.post(f"/webhooks/{name}", content=body, headers=SCHEME.sign(body))
                    for _ in range(3)
                ]
                for name in names
            }
        stored = client.post("/webhooks/good", content=body, headers=SCHEME.sign(body))
    statuses = {name: [a.status_code for a in sent] for name, sent in answers.items()}
    assert statuses == {
        "verify": [401] * 3,
        "ids": [400] * 3,
        "fallback": [400] * 3,
        "ordered": [400] * 3,
    }
    for sent in answers.values():
        assert all(a.headers["content-type"] == "application/problem+json" for a in sent)
    logged = [r for r in caplog.records if r.name == "pgonce.inbox"]
    assert len(logged) == len(names), [r.getMessage() for r in logged]
    by_source = {name: [r for r in logged if f"source {name} " in r.getMessage()] for name in names}
    assert all(len(found) == 1 for found in by_source.values()), by_source
    for name, words in {
        "verify": ("scheme generic-hmac", "RuntimeError: verify is broken", "answered 401"),
        "ids": ("event id extraction", "KeyError", "answered 400"),
        "fallback": ("event_id_fallback", "ValueError: the fallback is broken", "answered 400"),
        "ordered": ("ordering extractor", "KeyError", "answered 400"),
    }.items():
        (record,) = by_source[name]
        message = record.getMessage()
        for word in words:
            assert word in message, message
        assert record.exc_info is not None  # the traceback, once
    assert stored.status_code == 200
