"""The receiver's clock, through a real server."""

from __future__ import annotations

from datetime import datetime

import httpx
import pytest

from pgonce.errors import UsageError
from pgonce.webhooks.receiver import InboxReceiver
from pgonce.webhooks.schemes import build_scheme
from pgonce.webhooks.source import Source
from tests.inbox.conftest import SCHEMA, serve

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def test_a_clock_of_naive_datetimes_is_refused_at_construction(dsn: str) -> None:
    """``clock=datetime.now`` was accepted, and then every delivery of a scheme with a signed
    timestamp was answered 401, authentic or not, with a traceback in the log for each."""
    scheme = build_scheme("standard-webhooks", [SECRET])
    sources = [Source(name="shop", scheme=scheme)]
    try:
        receiver = InboxReceiver(sources, dsn=dsn, schema=SCHEMA, clock=datetime.now)
    except UsageError as error:
        assert "timezone-aware" in str(error)  # noqa: PT017 (what the error says is the point)
        return
    body = b'{"ok": true}'
    with serve(receiver) as url, httpx.Client(base_url=url) as client:
        answer = client.post("/webhooks/shop", content=body, headers=scheme.sign(body))
    pytest.fail(f"a naive clock was accepted; an authentic delivery was answered {answer}")
