"""A request body that ends before its Content-Length (the client went away while sending it).

gunicorn's ``wsgi.input`` then returns what arrived, short and without an error. The middleware
reads the body itself and hands the application a buffer of what it read: a body cut short must
be refused there, since the application could no longer tell (a form cut after ``amount=10`` of
``amount=1000`` is a valid form), and a claim of the cut body would answer the client's retry of
the whole one 422, the key bound to a request the client never made.
"""

from __future__ import annotations

import io
import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import psycopg
import pytest
from psycopg_pool import ConnectionPool

from pgonce.contrib.wsgi import IdempotencyMiddleware, StartResponse, connection_of
from tests.http.conftest import Server
from tests.loopback import read_to_close


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as opened:
        yield opened


def counts(dsn: str, table: str) -> tuple[int, int]:
    """(the rows of ``table``, the keys stored), as another connection sees them."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            f"SELECT (SELECT count(*) FROM {table}), (SELECT count(*) FROM pgonce.keys)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_a_body_shorter_than_its_content_length_is_refused_before_the_claim(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE charges (amount int)")

    def app(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        form = parse_qs(environ["wsgi.input"].read(length).decode())
        amount = int(form["amount"][0])
        connection_of(environ).execute("INSERT INTO charges VALUES (%s)", (amount,))
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [str(amount).encode()]

    wrapped = IdempotencyMiddleware(app, pool=pool, key_scope=lambda e: "tenant")
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
        seen.update(status=status, headers={n.lower(): v for n, v in headers})

    def post(sent: bytes) -> bytes:
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/charges",
            "CONTENT_TYPE": "application/x-www-form-urlencoded",
            "CONTENT_LENGTH": "11",
            "HTTP_IDEMPOTENCY_KEY": "charge-1",
            "wsgi.input": io.BytesIO(sent),  # what gunicorn gives when the client went away
        }
        return b"".join(wrapped(environ, start_response))

    body = post(b"amount=10")  # of "amount=1000": the last two bytes never came
    assert seen["status"].startswith("400 ")
    assert seen["headers"]["content-type"] == "application/problem+json"
    assert "Content-Length" in json.loads(body)["detail"]
    assert counts(dsn, "charges") == (0, 0)  # nothing ran, nothing was claimed

    assert post(b"amount=1000") == b"1000"  # the whole request runs, once
    assert seen["status"] == "201 Created"
    assert counts(dsn, "charges") == (1, 1)


def test_a_client_gone_mid_body_under_gunicorn_leaves_its_key_free(
    server: Server, dsn: str
) -> None:
    # A view that writes without reading the body (tests/flask/app.py's /cookie): before the
    # refusal, it ran and committed on the cut body, and the whole retry was answered 422.
    body = json.dumps({"amount": 1000, "currency": "EUR", "note": "x" * 64}).encode()
    address = urlsplit(server.url)
    with socket.create_connection((address.hostname or "", address.port or 80)) as sock:
        sock.sendall(
            b"POST /cookie HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer alice-token\r\nIdempotency-Key: cut-1\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body[:20]
        )
        sock.shutdown(socket.SHUT_WR)  # the client sends no more
        answer = read_to_close(sock)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert counts(dsn, "payments") == (0, 0)

    retried = httpx.post(
        server.url + "/cookie",
        content=body,
        headers={
            "Content-Type": "application/json",
            "Authorization": "Bearer alice-token",
            "Idempotency-Key": "cut-1",
        },
    )
    assert retried.status_code == 201, retried.text
    assert counts(dsn, "payments") == (1, 1)
