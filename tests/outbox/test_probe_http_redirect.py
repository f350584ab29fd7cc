"""A webhook endpoint that answers with a redirect (an http:// URL moved to https://, a path that
moved) is refused with a reason that says so and where it leads, since the publisher does not
follow redirects; the reason used to be a bare "answered 301"."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pgonce.core.outbox import OutboxMessage
from pgonce.publishers.http import HttpPublisher

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


class Moved(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(308)
        self.send_header("Location", "https://hooks.example:8443/v2/hooks?token=s3cret")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def moved_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Moved)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hooks"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_a_redirect_is_refused_saying_where_it_leads(moved_url: str) -> None:
    publisher = HttpPublisher(url=moved_url, secret=SECRET)
    message = OutboxMessage(1, "order", "1", "created", "{}", {}, datetime.now(UTC), 0)
    try:
        result = await publisher.publish([message])
    finally:
        await publisher.close()
    reason = result.refused[1]
    assert "answered 308" in reason
    assert "redirect to https://hooks.example:8443" in reason
    assert "does not follow redirects" in reason
    assert "s3cret" not in reason
