"""The SQLAlchemy payments example plus the endpoints that misbehave on purpose, for the adapter
conformance suite (tests/adapters): every write goes through the request's AsyncSession.

Started as ``python -m bench.servers FD tests.sqlalchemy_adapter.app:create_app``; the database
comes from ``PGONCE_TEST_HTTP_DSN`` and the middleware's options from
``PGONCE_TEST_HTTP_OPTIONS`` (JSON).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from examples.sqlalchemy_payments import app as payments
from examples.sqlalchemy_payments.app import IdempotentSession, Payment
from tests.http.app import middleware_options


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
        payment = await insert_payment(session)
        response = JSONResponse({"id": payment}, status_code=201)
        response.headers["Location"] = f"/payments/{payment}"
        response.headers["X-Custom"] = "kept"
        response.set_cookie("session", "secret-session-id")
        return response

    @app.post("/block")
    async def block(directory: str, session: IdempotentSession, status: int = 201) -> Response:
        # Signals "my write is done" with a file, then holds the transaction open until the test
        # creates the gate file (or kills the server). Every run leaves a line in "runs".
        payment = await insert_payment(session)
        folder = Path(directory)
        with (folder / "runs").open("a") as runs:
            runs.write(f"{payment}\n")
        (folder / "started").write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not (folder / "gate").exists():
            if time.monotonic() > deadline:
                return JSONResponse({"error": "gate never opened"}, status_code=500)
            await asyncio.sleep(0.01)
        return JSONResponse({"id": payment}, status_code=status)

    return app
