"""The SQLAlchemy payments example plus the endpoints that misbehave on purpose, for the adapter
conformance suite (tests/adapters): every write goes through the request's AsyncSession.

Started as ``python -m bench.servers FD tests.sqlalchemy_adapter.app:create_app``; the database
comes from ``PGONCE_TEST_HTTP_DSN`` and the middleware's options from
``PGONCE_TEST_HTTP_OPTIONS`` (JSON).
"""

from __future__ import annotations

import json
import os

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from examples.sqlalchemy_payments import app as payments
from examples.sqlalchemy_payments.app import IdempotentSession, Payment
from tests.http.app import hold, middleware_options, with_cookie


async def insert_payment(session: IdempotentSession, amount: int = 1) -> int:
    payment = Payment(principal="test", amount=amount, currency="EUR")
    session.add(payment)
    await session.flush()
    return payment.id


def create_app() -> FastAPI:
    options = json.loads(os.environ.get("PGONCE_TEST_HTTP_OPTIONS") or "{}")
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"], **middleware_options(options))

    @app.post("/boom")
    async def boom(session: IdempotentSession) -> Response:
        await insert_payment(session)
        raise RuntimeError("the endpoint failed after its write")

    @app.post("/fail")
    async def fail(session: IdempotentSession) -> Response:
        await insert_payment(session)
        return JSONResponse({"error": "upstream down"}, status_code=503)

    @app.post("/cookie")
    async def cookie(session: IdempotentSession) -> Response:
        return with_cookie(await insert_payment(session))

    @app.post("/no-db")
    async def no_db(session: IdempotentSession) -> Response:
        # Asks for the session (so the request's claim) and writes nothing.
        return JSONResponse({"nonce": os.urandom(8).hex()}, status_code=201)

    @app.post("/block")
    async def block(directory: str, session: IdempotentSession, status: int = 201) -> Response:
        return await hold(directory, await insert_payment(session), status)

    return app
