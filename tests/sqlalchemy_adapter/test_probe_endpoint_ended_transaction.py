"""An endpoint whose ``idempotent_session`` stays in use while it ends the request's transaction
behind SQLAlchemy's back (a COMMIT or ROLLBACK in SQL, or the psycopg connection's commit()):
settled as the ASGI middleware settles it for any endpoint (pgonce.http.semantics).

Committed, the claim went with the endpoint's writes before the response was stored: the
response is stored just after, so the key is not left in flight (every retry answered 409 until
the key expired, for work that was done). Rolled back, nothing of the request committed: the
client gets the "Transaction ended by the endpoint" problem and the retry runs. A flush that
failed, which SQLAlchemy rolled back itself, is still answered as the endpoint answers it.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from sqlalchemy import text

from examples.sqlalchemy_payments.app import IdempotentSession, create_app
from tests.http.test_http_middleware import keys, payments
from tests.sqlalchemy_adapter.app import insert_payment

HEADERS = {"Authorization": "Bearer alice-token", "Idempotency-Key": '"k"'}


def _app(dsn: str) -> Any:
    app = create_app(dsn)

    @app.post("/sql/{end}")
    async def in_sql(end: str, session: IdempotentSession) -> JSONResponse:
        payment = await insert_payment(session)
        await session.execute(text(end.upper()))
        return JSONResponse({"id": payment}, status_code=201)

    @app.post("/driver-commit")
    async def driver_commit(session: IdempotentSession) -> JSONResponse:
        payment = await insert_payment(session)
        raw = await (await session.connection()).get_raw_connection()
        await raw.driver_connection.commit()  # type: ignore[union-attr]
        return JSONResponse({"id": payment}, status_code=201)

    return app


@pytest.mark.parametrize("path", ["/sql/commit", "/driver-commit"])
def test_a_commit_by_the_endpoint_stores_its_answer_and_leaves_no_key_in_flight(
    dsn: str, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    with TestClient(_app(dsn)) as client:
        first = client.post(path, json={}, headers=HEADERS)
        again = client.post(path, json={}, headers=HEADERS)
    assert first.status_code == again.status_code == 201
    assert "idempotency-key-expires" in first.headers
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.content == first.content
    with psycopg.connect(dsn, autocommit=True) as db:
        assert (payments(db), keys(db)) == (1, 1)
    assert "transaction ended by its endpoint" in caplog.text


def test_a_rollback_in_sql_by_the_endpoint_is_a_problem_and_frees_the_key(dsn: str) -> None:
    with TestClient(_app(dsn)) as client:
        for _ in range(2):  # nothing kept: the retry runs again, and is answered the same
            answer = client.post("/sql/rollback", json={}, headers=HEADERS)
            assert answer.status_code == 500
            assert answer.json()["title"] == "Transaction ended by the endpoint"
    with psycopg.connect(dsn, autocommit=True) as db:
        assert (payments(db), keys(db)) == (0, 0)
