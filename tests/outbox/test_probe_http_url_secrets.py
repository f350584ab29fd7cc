"""A webhook URL that carries a credential (a password, a token in the path or the query, as many
receivers authenticate) is never written to the logs, httpx's own line per request included."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from pgonce.publishers.http import HttpPublisher
from tests.outbox.conftest import outbox_rows

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


@contextlib.asynccontextmanager
async def endpoint() -> AsyncIterator[int]:
    """A port whose endpoint answers 204 to each request (its body read first)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def test_a_url_with_credentials_is_logged_by_its_origin_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with endpoint() as port:
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
