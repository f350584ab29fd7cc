"""One app initialized twice (``Idempotency(app, ...)`` at import and ``init_app(app, ...)`` in
the app factory): two middlewares would each claim the key, the inner one on another
connection, waiting for the outer one's uncommitted claim, and every covered request would be
answered 409 "in progress" for ever. The second initialization is refused instead."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from flask import Flask
from psycopg_pool import ConnectionPool

from pgonce import UsageError
from pgonce.contrib.flask import Idempotency, connection
from pgonce.contrib.wsgi import IdempotencyMiddleware


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool[Any]]:
    with ConnectionPool(dsn, min_size=1, max_size=4, open=True) as opened:
        yield opened


def app_with_a_view() -> Flask:
    app = Flask(__name__)

    @app.post("/payments")
    def pay() -> tuple[str, int]:
        connection().execute("SELECT 1")
        return "made", 201

    return app


def test_a_second_initialization_of_one_app_is_refused_and_the_first_serves(
    pool: ConnectionPool[Any], dsn: str
) -> None:
    app = app_with_a_view()
    Idempotency(app, pool=pool, key_scope=lambda environ: "tenant")
    with pytest.raises(UsageError, match="already initialized on this app"):
        Idempotency().init_app(app, pool=pool, key_scope=lambda environ: "tenant")
    with pytest.raises(UsageError, match="already initialized on this app"):
        Idempotency(app, pool=pool, key_scope=lambda environ: "tenant")

    client = app.test_client()
    first = client.post("/payments", headers={"Idempotency-Key": "k"})
    again = client.post("/payments", headers={"Idempotency-Key": "k"})
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["Idempotent-Replayed"] == "true"
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT response_status FROM pgonce.keys").fetchall() == [(201,)]


def test_an_app_already_wrapped_by_the_middleware_is_refused(pool: ConnectionPool[Any]) -> None:
    app = app_with_a_view()
    app.wsgi_app = IdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, pool=pool, key_scope=lambda environ: "tenant"
    )
    with pytest.raises(UsageError, match="already an IdempotencyMiddleware"):
        Idempotency(app, pool=pool, key_scope=lambda environ: "tenant")


def test_one_extension_serves_two_apps(pool: ConnectionPool[Any]) -> None:
    extension = Idempotency()
    for app in (app_with_a_view(), app_with_a_view()):  # an app factory's apps
        extension.init_app(app, pool=pool, key_scope=lambda environ: "tenant")
        answer = app.test_client().post("/payments", headers={"Idempotency-Key": str(id(app))})
        assert answer.status_code == 201
