"""How ``idempotent_session`` ends the endpoint's session when the dependency exits: what the
endpoint left unflushed is written into the request's transaction, a savepoint it left open is
rolled back, the session's listeners of its end run, and its objects are detached, whether the
end has anything to send to the database or not."""

from __future__ import annotations

from typing import Any

import psycopg
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from sqlalchemy import event, inspect
from sqlalchemy.orm import Session, SessionTransaction

from examples.sqlalchemy_payments.app import IdempotentSession, Payment, create_app
from tests.http.test_http_middleware import keys, payments
from tests.sqlalchemy_adapter.app import insert_payment

HEADERS = {"Authorization": "Bearer alice-token", "Idempotency-Key": '"k"'}


def _amounts(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as db:
        return [row[0] for row in db.execute("SELECT amount FROM payments ORDER BY amount")]


def test_an_object_added_and_not_flushed_commits_with_the_stored_answer(dsn: str) -> None:
    app = create_app(dsn)

    @app.post("/unflushed")
    async def unflushed(session: IdempotentSession) -> JSONResponse:
        session.add(Payment(principal="test", amount=7, currency="EUR"))
        return JSONResponse({"ok": True}, status_code=201)

    with TestClient(app) as client:
        first = client.post("/unflushed", json={}, headers=HEADERS)
        again = client.post("/unflushed", json={}, headers=HEADERS)
    assert first.status_code == again.status_code == 201
    assert again.headers.get("idempotent-replayed") == "true"
    assert _amounts(dsn) == [7]
    with psycopg.connect(dsn, autocommit=True) as db:
        assert keys(db) == 1


def test_a_savepoint_left_open_is_rolled_back_and_the_rest_commits(dsn: str) -> None:
    app = create_app(dsn)

    @app.post("/open-savepoint")
    async def open_savepoint(session: IdempotentSession) -> JSONResponse:
        await insert_payment(session, 1)
        await session.begin_nested()
        await insert_payment(session, 2)
        return JSONResponse({"ok": True}, status_code=201)

    with TestClient(app) as client:
        assert client.post("/open-savepoint", json={}, headers=HEADERS).status_code == 201
    assert _amounts(dsn) == [1]


def test_the_session_is_closed_and_its_end_listeners_run(dsn: str) -> None:
    app = create_app(dsn)
    seen: list[Any] = []
    ended: list[SessionTransaction] = []

    def end(session: Session, transaction: SessionTransaction) -> None:
        ended.append(transaction)

    @app.post("/flushed")
    async def flushed(session: IdempotentSession) -> JSONResponse:
        payment = Payment(principal="test", amount=3, currency="EUR")
        session.add(payment)
        await session.flush()
        seen.append(payment)
        return JSONResponse({"ok": True}, status_code=201)

    @app.post("/listened")
    async def listened(session: IdempotentSession) -> JSONResponse:
        event.listen(session.sync_session, "after_transaction_end", end)
        await insert_payment(session, 4)
        return JSONResponse({"ok": True}, status_code=201)

    with TestClient(app) as client:
        assert client.post("/flushed", json={}, headers=HEADERS).status_code == 201
        other = {**HEADERS, "Idempotency-Key": '"k2"'}
        assert client.post("/listened", json={}, headers=other).status_code == 201
    assert inspect(seen[0]).detached
    assert ended[-1].parent is None  # the session's own, at its close (a flush's before)
    with psycopg.connect(dsn, autocommit=True) as db:
        assert (payments(db), keys(db)) == (2, 2)
