"""The Flask ``connection()`` accessor answers the same on each of its ways: the claim's
connection in the view (marking it begun, so that its answer is stored), the refusal once the
request's transaction ended (a ``call_on_close`` function), and the same answers where Flask keeps
its request context somewhere else than the context variable the accessor reads first."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask, Response, request
from psycopg_pool import ConnectionPool

from pgonce import UsageError
from pgonce.contrib import flask as pgonce_flask
from pgonce.contrib.flask import Idempotency, connection
from tests.flask import test_flask_units as units


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(dsn, min_size=1, max_size=2, open=True) as opened:
        yield opened


@pytest.fixture(params=["context variable", "public accessors"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "public accessors":
        monkeypatch.setattr(pgonce_flask, "_request_context", None)
    way: str = request.param
    return way


def stored(dsn: str) -> list[tuple[str, int | None]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT key, response_status FROM pgonce.keys ORDER BY key")
        return [(key, status) for key, status in rows]


def test_the_views_connection_is_the_claims_and_its_answer_is_stored(
    pool: ConnectionPool[Any], dsn: str, way: str
) -> None:
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=lambda environ: "tenant")
    refused: list[UsageError] = []

    @app.post("/things")
    def things() -> Response:
        status = connection().info.transaction_status
        response = Response(str(status == psycopg.pq.TransactionStatus.INTRANS), 201)
        environ = request.environ

        def on_close() -> None:
            # Flask's request context is gone by then: the request's again, its transaction
            # ended and its connection back in the pool.
            with app.request_context(environ):
                try:
                    connection()
                except UsageError as refusal:
                    refused.append(refusal)

        response.call_on_close(on_close)
        return response

    client = app.test_client()
    made = client.post("/things", headers={"Idempotency-Key": "k-1"})
    assert (made.status_code, made.text) == (201, "True")
    made.close()
    assert len(refused) == 1
    assert "idempotent transaction has ended" in str(refused[0])
    assert stored(dsn) == [("k-1", 201)]
    replay = client.post("/things", headers={"Idempotency-Key": "k-1"})
    assert replay.headers["Idempotent-Replayed"] == "true"


def test_outside_a_claimed_request_the_accessor_says_why(
    pool: ConnectionPool[Any], way: str
) -> None:
    with pytest.raises(UsageError, match="inside a Flask request"):
        connection()
    # The rest as the units say it, on each way of reading the request.
    units.test_the_accessors_outside_a_claimed_request_say_why(pool)
