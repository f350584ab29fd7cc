"""The WSGI middleware in-process (Flask's test client, a bare WSGI app) on a real pool and a real
database: misuse refused with a clear error, and the WSGI details a server does not show."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg_pool import ConnectionPool

from pgonce import AsyncKeyStore, UsageError
from pgonce.contrib.flask import Idempotency, connection, transaction
from pgonce.contrib.wsgi import (
    IdempotencyMiddleware,
    StartResponse,
    connection_of,
    header_scope,
)


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as opened:
        yield opened


def keys(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pgonce.keys").fetchone()
    assert row is not None
    return int(row[0])


def test_misuse_is_refused_when_the_app_is_built(pool: ConnectionPool[Any]) -> None:
    def app(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        return []

    with pytest.raises(UsageError, match="Flask app"):
        Idempotency(app, pool=pool, key_scope=lambda e: "s")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="key_scope"):
        IdempotencyMiddleware(app, pool=pool, key_scope="tenant")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="pool"):
        IdempotencyMiddleware(app, pool=object(), key_scope=lambda e: "s")  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="sync one"):
        IdempotencyMiddleware(
            app,
            pool=pool,
            key_scope=lambda e: "s",
            store=AsyncKeyStore(),  # type: ignore[arg-type]
        )


def test_the_accessors_outside_a_claimed_request_say_why(pool: ConnectionPool[Any]) -> None:
    with pytest.raises(UsageError, match="inside a Flask request"):
        transaction()
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=lambda e: "s")
    with (
        app.test_request_context("/things", method="GET"),
        pytest.raises(UsageError, match="no idempotent transaction"),
    ):
        connection()


def test_a_view_that_asks_for_the_claim_of_an_anonymous_request_is_401(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=header_scope("X-Api-Key"))

    @app.post("/things")
    def things() -> tuple[str, int]:
        connection().execute("SELECT 1")
        return "made", 201

    client = app.test_client()
    anonymous = client.post("/things", headers={"Idempotency-Key": "k"})
    assert anonymous.status_code == 401
    assert anonymous.headers["Content-Type"] == "application/problem+json"
    made = client.post("/things", headers={"Idempotency-Key": "k", "X-Api-Key": "secret"})
    assert made.status_code == 201
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT scope FROM pgonce.keys").fetchone()
    assert row is not None
    assert "secret" not in row[0]  # the credential is stored as its SHA-256 only


def test_a_bare_wsgi_app_with_write_and_close_is_captured_whole(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    closed: list[bool] = []

    class Body:
        def __iter__(self) -> Iterator[bytes]:
            yield b"-tail"

        def close(self) -> None:
            closed.append(True)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Body:
        connection_of(environ).execute("SELECT 1")
        write = start_response("202 Accepted", [("Content-Type", "text/plain")])
        write(b"head")  # PEP 3333's legacy write(): its bytes come first
        return Body()

    wrapped = IdempotencyMiddleware(app, pool=pool, key_scope=lambda e: "tenant")
    answers = []
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
        seen.update(status=status, headers=dict(headers))

    for _ in range(2):
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/jobs",
            "CONTENT_LENGTH": "2",
            "HTTP_IDEMPOTENCY_KEY": "job-1",
            "wsgi.input": io.BytesIO(b"{}"),
        }
        body = b"".join(wrapped(environ, start_response))
        answers.append((seen["status"], body, seen["headers"]))
    (status, body, headers), (status2, body2, headers2) = answers
    assert (status, body) == (status2, body2) == ("202 Accepted", b"head-tail")
    assert "idempotency-key-expires" in headers
    assert headers2["idempotent-replayed"] == "true"
    assert closed == [True]  # the first run's iterable was closed; the replay ran nothing
    assert keys(dsn) == 1


def test_a_response_header_outside_latin_1_is_refused_and_nothing_is_kept(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    # PEP 3333: header values are latin-1. One a server could not send is never stored (the
    # application fails, its transaction and the claim roll back); a retry could not replay it.
    def app(environ: dict[str, Any], start_response: StartResponse) -> list[bytes]:
        connection_of(environ).execute("SELECT 1")
        start_response("201 Created", [("Location", "/caf\u00e9/\u20ac")])
        return [b"{}"]

    wrapped = IdempotencyMiddleware(app, pool=pool, key_scope=lambda e: "tenant")
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/jobs",
        "CONTENT_LENGTH": "2",
        "HTTP_IDEMPOTENCY_KEY": "euro-1",
        "wsgi.input": io.BytesIO(b"{}"),
    }

    def start_response(status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
        raise AssertionError("nothing is answered")

    with pytest.raises(UnicodeEncodeError):
        wrapped(environ, start_response)
    assert keys(dsn) == 0
