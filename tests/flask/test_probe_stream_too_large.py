"""A streamed response that grows past ``max_response_bytes`` under the WSGI middleware.

Its answer is decided once it exceeds the limit (the 500 problem, nothing kept): the middleware
must stop reading the stream there and close it, as the ASGI middleware does, not read on to its
end while the client waits and the key stays in flight (an endless server-sent stream on a POST
never ends). Served by a real WSGI server (wsgiref's) in a thread, on a real database.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from flask import Flask, Response, stream_with_context
from psycopg_pool import ConnectionPool

from pgonce.contrib.flask import Idempotency, connection
from pgonce.contrib.wsgi import IdempotencyMiddleware
from tests.flask.test_flask_units import written
from tests.flask.test_probe_wsgi_sqlalchemy_unavailable import serve

LIMIT = 100_000
CHUNK = b"data: tick\n\n" + b" " * 10_000
#: Far more than the limit: a stream read to its end yields all of these.
CHUNKS = 5_000


class Stream:
    """What the stream yielded, and whether it was closed."""

    def __init__(self) -> None:
        self.yielded = 0
        self.closed = threading.Event()

    def ticks(self) -> Iterator[bytes]:
        try:
            connection().execute("INSERT INTO things VALUES ('tick')")
            for _ in range(CHUNKS):
                self.yielded += 1
                yield CHUNK
        finally:
            self.closed.set()


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE things (name text)")
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as opened:
        yield opened


def test_a_stream_past_the_limit_is_stopped_and_answered_too_large(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    stream = Stream()
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=lambda environ: "tenant", max_response_bytes=LIMIT)

    @app.post("/events")
    def events() -> Response:
        return Response(stream_with_context(stream.ticks()), mimetype="text/event-stream")

    with serve(app) as url:
        for _ in range(2):  # nothing kept: the retry runs again, and is answered the same
            stream.yielded = 0
            stream.closed.clear()
            answer = httpx.post(url + "/events", headers={"Idempotency-Key": "k"}, timeout=15)
            assert answer.status_code == 500
            assert answer.headers["Content-Type"] == "application/problem+json"
            assert answer.json()["title"] == "Response too large to store"
            assert stream.closed.is_set()
            # Stopped at the chunk that went past the limit, not read to the end.
            assert stream.yielded == LIMIT // len(CHUNK) + 1
    assert written(dsn) == (0, 0)


def test_writes_past_the_limit_are_stopped_and_answered_too_large(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    calls: list[int] = []

    def legacy(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        write = start_response("200 OK", [("Content-Type", "text/plain")])
        environ["pgonce.transaction"].connection.execute("INSERT INTO things VALUES ('w')")
        for _ in range(CHUNKS):
            calls.append(1)
            write(CHUNK)
        return []

    app = IdempotencyMiddleware(
        legacy, pool=pool, key_scope=lambda environ: "tenant", max_response_bytes=LIMIT
    )
    with serve(app) as url:
        answer = httpx.post(url + "/events", headers={"Idempotency-Key": "k"}, timeout=15)
    assert answer.status_code == 500
    assert answer.json()["title"] == "Response too large to store"
    assert len(calls) == LIMIT // len(CHUNK) + 1
    assert written(dsn) == (0, 0)
