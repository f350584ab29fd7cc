"""An endpoint whose SQLAlchemy session loses the database gets the 503 with Retry-After that
psycopg's own errors get, under the ASGI middleware as under Flask and WSGI: never a 500."""

from __future__ import annotations

from typing import Any

import psycopg
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from examples.sqlalchemy_payments.app import IdempotentSession, create_app
from tests.http.test_http_middleware import keys, payments
from tests.sqlalchemy_adapter.app import insert_payment

HEADERS = {"Authorization": "Bearer alice-token", "Idempotency-Key": '"k"'}


def test_a_session_whose_connection_is_cut_is_answered_503_and_the_retry_runs(dsn: str) -> None:
    app = create_app(dsn)
    cut = [True]

    @app.post("/cut")
    async def cut_off(session: IdempotentSession) -> dict[str, Any]:
        await insert_payment(session)
        if cut.pop() if cut else False:
            # The server ends the request's backend, as a failover or an administrator does.
            await session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        return {"ok": True}

    with TestClient(app, raise_server_exceptions=False) as client:
        lost = client.post("/cut", json={}, headers=HEADERS)
        assert lost.status_code == 503, lost.text
        assert lost.headers["retry-after"]
        assert lost.headers["content-type"] == "application/problem+json"
        with psycopg.connect(dsn, autocommit=True) as db:
            assert (payments(db), keys(db)) == (0, 0)
        retried = client.post("/cut", json={}, headers=HEADERS)
        assert retried.status_code == 200, retried.text
    with psycopg.connect(dsn, autocommit=True) as db:
        assert (payments(db), keys(db)) == (1, 1)


def test_another_engine_that_cannot_connect_is_answered_503(dsn: str) -> None:
    app = create_app(dsn)
    gone = create_async_engine("postgresql+psycopg://postgres@127.0.0.1:1/test")

    @app.post("/elsewhere")
    async def elsewhere(session: IdempotentSession) -> dict[str, Any]:
        await insert_payment(session)
        async with gone.connect() as other:
            await other.execute(text("SELECT 1"))
        return {}

    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/elsewhere", json={}, headers=HEADERS)
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"]
    with psycopg.connect(dsn, autocommit=True) as db:
        assert (payments(db), keys(db)) == (0, 0)
