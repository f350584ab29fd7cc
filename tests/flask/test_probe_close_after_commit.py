"""A Flask response's ``call_on_close`` functions (the WSGI iterable's ``close()``) run after the
request's transaction ended, under gunicorn: a job they start (enqueue work that reads the
payment) finds the payment committed, and none runs while the claim's transaction is still open,
to be rolled back after it. This module is also the app: ``create_app()`` is the Flask example
plus these routes.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from flask import Flask, Response, after_this_request
from psycopg_pool import ConnectionPool

from examples.flask_payments import app as payments
from pgonce import UsageError
from pgonce.contrib.wsgi import IdempotencyMiddleware, StartResponse, connection_of
from tests.adapters.conftest import FLASK_GUNICORN
from tests.flask.app import insert_payment
from tests.http.conftest import Server, servers_of

ARGV = (*FLASK_GUNICORN[:-1], f"{__name__}:create_app()")
ALICE = {"Authorization": "Bearer alice-token"}
CHANNEL = "pgonce_closed"

#: What a job started on close sees, on a connection of its own: the payment, and whether any
#: other connection of the database is still inside a transaction (the claim's, not yet ended).
SEEN = b"""
SELECT (SELECT count(*) FROM payments WHERE id = %(id)s),
       (SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()
           AND state LIKE 'idle in transaction%%')
"""


def on_close(payment: int, key: str) -> None:
    """The job a view starts when its response is closed: reads the payment, and says what it
    saw on the test's channel (its effect)."""
    with psycopg.connect(os.environ["PGONCE_TEST_HTTP_DSN"], autocommit=True) as conn:
        row = conn.execute(SEEN, {"id": payment}).fetchone()
        assert row is not None
        seen = {"key": key, "payments": row[0], "open": row[1]}
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, json.dumps(seen)))


def create_app() -> Flask:
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"])

    def enqueue_on_close(payment: int, key: str) -> None:
        @after_this_request
        def register(response: Response) -> Response:
            response.call_on_close(lambda: on_close(payment, key))
            return response

    @app.post("/queued/<key>")
    def queued(key: str) -> tuple[dict[str, int], int]:
        payment = insert_payment()
        enqueue_on_close(payment, key)
        return {"id": payment}, 201

    @app.post("/queued-failing/<key>")
    def queued_failing(key: str) -> tuple[dict[str, str], int]:
        # A 503 is not stored: the payment rolls back with the claim.
        enqueue_on_close(insert_payment(), key)
        return {"error": "upstream down"}, 503

    return app


@pytest.fixture
def server(dsn: str, tmp_path: Path) -> Iterator[Server]:
    with servers_of(dsn, tmp_path, ARGV) as make:
        yield make()


@pytest.fixture
def listener(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"LISTEN {CHANNEL}")
        yield conn


def post(server: Server, path: str) -> httpx.Response:
    headers = {**ALICE, "Idempotency-Key": f'"{uuid.uuid4().hex}"'}
    return httpx.post(server.url + path, json={}, headers=headers, timeout=30)


def seen_on_close(listener: psycopg.Connection[Any], key: str) -> dict[str, Any]:
    for notify in listener.notifies(timeout=30, stop_after=1):
        seen: dict[str, Any] = json.loads(notify.payload)
        assert seen["key"] == key
        return seen
    raise AssertionError("the response's call_on_close function never ran")


def test_a_job_started_on_close_finds_the_payment_committed(
    server: Server, listener: psycopg.Connection[Any]
) -> None:
    key = uuid.uuid4().hex
    response = post(server, f"/queued/{key}")
    assert response.status_code == 201, response.text
    seen = seen_on_close(listener, key)
    assert seen == {"key": key, "payments": 1, "open": 0}


def test_a_job_started_on_close_runs_after_the_rollback(
    server: Server, listener: psycopg.Connection[Any]
) -> None:
    key = uuid.uuid4().hex
    response = post(server, f"/queued-failing/{key}")
    assert response.status_code == 503, response.text
    seen = seen_on_close(listener, key)
    assert seen == {"key": key, "payments": 0, "open": 0}


def test_a_bare_wsgi_apps_iterable_is_closed_by_the_server_after_the_commit(dsn: str) -> None:
    seen: list[tuple[int, bool]] = []

    def count(conn: psycopg.Connection[Any]) -> int:
        row = conn.execute("SELECT count(*) FROM payments").fetchone()
        assert row is not None
        return int(row[0])

    class Body:
        def __init__(self, environ: dict[str, Any]) -> None:
            self.environ = environ

        def __iter__(self) -> Iterator[bytes]:
            yield b"queued"

        def close(self) -> None:
            with psycopg.connect(dsn, autocommit=True) as other:
                try:
                    connection_of(self.environ)
                except UsageError:
                    refused = True
                else:
                    refused = False
                seen.append((count(other), refused))

    def app(environ: dict[str, Any], start_response: StartResponse) -> Body:
        connection_of(environ).execute(
            "INSERT INTO payments (principal, amount, currency) VALUES ('test', 1, 'EUR')"
        )
        start_response("201 Created", [("Content-Type", "text/plain")])
        return Body(environ)

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(payments.CREATE_TABLE)
    answers: list[str] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc: Any = None) -> Any:
        answers.append(status)

    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as pool:
        wrapped = IdempotencyMiddleware(app, pool=pool, key_scope=lambda e: "tenant")
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/jobs",
            "CONTENT_LENGTH": "2",
            "HTTP_IDEMPOTENCY_KEY": '"job-1"',
            "wsgi.input": io.BytesIO(b"{}"),
        }
        result: Iterable[bytes] = wrapped(environ, start_response)
        assert b"".join(result) == b"queued"
        assert answers == ["201 Created"]
        assert seen == []  # a server closes the iterable after sending the answer (PEP 3333)
        close = getattr(result, "close", None)
        assert close is not None
        close()
    # After the commit, and the claim's connection is no longer the application's.
    assert seen == [(1, True)]
