"""What only the SQLAlchemy HTTP path has (the conformance suite, tests/adapters, holds the rest):
the endpoint's session may not commit the request's transaction, and needs the middleware on an
engine."""

from __future__ import annotations

from typing import Annotated, Any

import psycopg
import pytest
from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from psycopg_pool import AsyncConnectionPool
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from examples.payments.app import key_scope
from examples.sqlalchemy_payments.app import IdempotentSession, Payment, create_app
from pgonce.contrib.sqlalchemy import (
    EngineConnections,
    NotPsycopgSession,
    SessionCommitRefused,
    SessionRollbackRefused,
    idempotent_session,
)
from pgonce.errors import UsageError
from pgonce.http import IdempotencyMiddleware
from tests.http.test_http_middleware import keys, payments
from tests.keys.helpers import sqlalchemy_url
from tests.sqlalchemy_adapter.app import insert_payment

HEADERS = {"Authorization": "Bearer alice-token", "Idempotency-Key": '"k"'}


def test_a_session_commit_in_the_endpoint_is_refused_and_nothing_commits(dsn: str) -> None:
    app = create_app(dsn)

    @app.post("/commit")
    async def commit(session: IdempotentSession) -> dict[str, Any]:
        await insert_payment(session)
        await session.commit()
        return {}

    with TestClient(app) as client, pytest.raises(SessionCommitRefused, match=r"session\.flush"):
        client.post("/commit", json={}, headers=HEADERS)
    with psycopg.connect(dsn, autocommit=True) as db:
        assert (payments(db), keys(db)) == (0, 0)


def test_a_session_rollback_in_the_endpoint_is_refused_and_nothing_commits(dsn: str) -> None:
    # The usual idiom (flush, catch, rollback, write the fallback) rolled back the claim with the
    # endpoint's writes, and the client got 201 for a transaction that stored nothing.
    app = create_app(dsn)

    @app.post("/rollback")
    async def rollback(session: IdempotentSession) -> dict[str, Any]:
        await insert_payment(session)
        await session.rollback()
        await insert_payment(session)
        return {}

    with TestClient(app) as client, pytest.raises(SessionRollbackRefused, match="begin_nested"):
        client.post("/rollback", json={}, headers=HEADERS)
    with psycopg.connect(dsn, autocommit=True) as db:
        assert (payments(db), keys(db)) == (0, 0)


def test_a_failed_flush_caught_by_the_endpoint_is_answered_and_not_stored(dsn: str) -> None:
    # SQLAlchemy rolls the request's transaction back when a flush fails (the claim with it);
    # the endpoint answers 409 for the duplicate. That answer goes out, nothing is stored, and
    # the retry runs again: never a 500 for a transaction SQLAlchemy ended itself.
    app = create_app(dsn)

    @app.post("/duplicate")
    async def duplicate(session: IdempotentSession) -> Any:
        first = await insert_payment(session)
        session.expunge_all()
        session.add(Payment(id=first, principal="test", amount=1, currency="EUR"))
        try:
            await session.flush()
        except IntegrityError:
            return JSONResponse({"error": "duplicate"}, status_code=409)
        return {}

    with TestClient(app) as client:
        for _ in range(2):
            answer = client.post("/duplicate", json={}, headers=HEADERS)
            assert answer.status_code == 409
            assert answer.json() == {"error": "duplicate"}
            assert "idempotency-key-expires" not in answer.headers
            assert "idempotent-replayed" not in answer.headers
    with psycopg.connect(dsn, autocommit=True) as db:
        assert (payments(db), keys(db)) == (0, 0)


def test_an_http_exception_after_a_write_rolls_back_and_is_not_stored(dsn: str) -> None:
    # Starlette answers the exception inside the middleware, which then sees a 409 like any
    # other: the session's dependency, which the exception passes through, fails the request.
    app = create_app(dsn)

    @app.post("/conflict")
    async def conflict(session: IdempotentSession) -> dict[str, Any]:
        await insert_payment(session)
        raise HTTPException(409, "conflict")

    with TestClient(app) as client:
        for _ in range(2):  # the retry runs again: nothing was stored
            answer = client.post("/conflict", json={}, headers=HEADERS)
            assert answer.status_code == 409
            assert "idempotent-replayed" not in answer.headers
    with psycopg.connect(dsn, autocommit=True) as db:
        assert (payments(db), keys(db)) == (0, 0)


def test_the_session_needs_the_middleware_on_an_engine(dsn: str) -> None:
    pool = AsyncConnectionPool(dsn, open=False)
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, pool=pool, key_scope=key_scope)

    @app.post("/payments")
    async def create(
        session: Annotated[AsyncSession, Depends(idempotent_session)],
    ) -> dict[str, Any]:
        return {}

    with TestClient(app) as client:
        portal = client.portal
        assert portal is not None
        portal.call(pool.open)
        try:
            with pytest.raises(UsageError, match="EngineConnections"):
                client.post("/payments", json={}, headers=HEADERS)
        finally:
            portal.call(pool.close)


async def test_an_engine_on_another_driver_is_refused_with_the_scheme_to_use(dsn: str) -> None:
    engine = create_async_engine(sqlalchemy_url(dsn, "asyncpg"))
    try:
        with pytest.raises(NotPsycopgSession, match=r"postgresql\+psycopg://"):
            EngineConnections(engine)
    finally:
        await engine.dispose()
