"""Flask's request hooks around a covered view, under gunicorn: an ``after_request`` function that
rewrites the answer (an envelope, a request id) and a ``teardown_request`` function that writes an
audit row. What the first client got is what a retry gets, and the hooks' writes commit once, with
the key. This module is also the app: ``create_app()`` is the Flask example plus these routes.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from flask import Flask, Response, request

from examples.flask_payments import app as payments
from pgonce.contrib.flask import connection
from tests.adapters.conftest import FLASK_GUNICORN
from tests.flask.app import insert_payment
from tests.http.conftest import Server, servers_of

ARGV = (*FLASK_GUNICORN[:-1], f"{__name__}:create_app()")
ALICE = {"Authorization": "Bearer alice-token"}
AUDIT = "CREATE TABLE IF NOT EXISTS audit (path text NOT NULL, status int NOT NULL)"


def create_app() -> Flask:
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"])
    with app.extensions["payments.pool"].connection() as conn:
        conn.execute(AUDIT)

    @app.post("/enveloped")
    def enveloped() -> tuple[dict[str, int], int]:
        return {"id": insert_payment()}, 201

    @app.after_request
    def envelope(response: Response) -> Response:
        if request.path == "/enveloped":
            request_id = uuid.uuid4().hex
            data = json.loads(response.get_data())
            response.set_data(json.dumps({"data": data, "request_id": request_id}))
            response.headers["X-Request-Id"] = request_id
        return response

    @app.post("/audited")
    def audited() -> tuple[dict[str, int], int]:
        return {"id": insert_payment()}, 201

    @app.teardown_request
    def audit(error: BaseException | None) -> None:
        if request.path == "/audited" and error is None:
            connection().execute(
                "INSERT INTO audit (path, status) VALUES (%s, 201)", (request.path,)
            )

    return app


@pytest.fixture
def server(dsn: str, tmp_path: Path) -> Iterator[Server]:
    with servers_of(dsn, tmp_path, ARGV) as make:
        yield make()


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


def post(server: Server, path: str, key: str) -> httpx.Response:
    headers = {**ALICE, "Idempotency-Key": key}
    return httpx.post(server.url + path, json={}, headers=headers, timeout=30)


def scalar(db: psycopg.Connection[Any], query: str) -> Any:
    row = db.execute(query).fetchone()
    assert row is not None
    return row[0]


def test_an_after_request_rewrite_is_what_the_retry_gets(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = uuid.uuid4().hex
    first = post(server, "/enveloped", key)
    assert first.status_code == 201, first.text
    request_id = first.json()["request_id"]
    assert first.headers["x-request-id"] == request_id
    again = post(server, "/enveloped", key)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["x-request-id"] == request_id
    assert scalar(db, "SELECT count(*) FROM payments") == 1


def test_a_teardown_functions_write_commits_once_with_the_key(
    server: Server, db: psycopg.Connection[Any]
) -> None:
    key = uuid.uuid4().hex
    first = post(server, "/audited", key)
    assert first.status_code == 201, first.text
    again = post(server, "/audited", key)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert scalar(db, "SELECT count(*) FROM payments") == 1
    assert scalar(db, "SELECT count(*) FROM audit") == 1
