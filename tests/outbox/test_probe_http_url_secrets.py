"""A webhook URL that carries a credential (a password, a token in the path or the query, as many
receivers authenticate) is never written to the logs, httpx's own line per request included."""

from __future__ import annotations

import logging

import httpx
import pytest

from pgonce.publishers.http import HttpPublisher
from tests.outbox.conftest import outbox_rows
from tests.outbox.http_endpoints import answering

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


async def test_a_url_with_credentials_is_logged_by_its_origin_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with answering() as (port, _):
        url = f"http://hooks:pass-in-url@127.0.0.1:{port}/t/token-in-path?key=token-in-query"
        publisher = HttpPublisher(secret=SECRET, url=url)
        try:
            result = await publisher.publish(outbox_rows(3))
        finally:
            await publisher.close()
        # Another httpx client in the process is not the publisher's to change.
        async with httpx.AsyncClient() as other:
            await other.post(f"http://127.0.0.1:{port}/elsewhere?mine=1", content=b"{}")
    assert result.acked == {1, 2, 3}
    logged = [r.getMessage() for r in caplog.records]
    for secret in ("pass-in-url", "token-in-path", "token-in-query"):
        assert not [line for line in logged if secret in line], logged
    requests = [line for line in logged if line.startswith("HTTP Request: POST")]
    assert (
        requests.count(f'HTTP Request: POST http://127.0.0.1:{port} "HTTP/1.1 204 No Content"') == 3
    )
    assert any(f"127.0.0.1:{port}/elsewhere?mine=1" in line for line in requests), requests
