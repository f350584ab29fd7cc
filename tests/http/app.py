"""The payments example plus endpoints that misbehave on purpose, served by uvicorn in the tests.

Started as ``uvicorn --factory tests.http.app:create_app``; the database comes from
``PGONCE_TEST_HTTP_DSN`` and the middleware's options from ``PGONCE_TEST_HTTP_OPTIONS`` (JSON).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from examples.payments import app as payments
from pgonce import AsyncKeyStore
from pgonce.http import IdempotentTransaction, idempotent_transaction

Tx = IdempotentTransaction


def middleware_options(raw: dict[str, Any]) -> dict[str, Any]:
    options = dict(raw)
    if "wait_ms" in options:
        options["wait"] = timedelta(milliseconds=options.pop("wait_ms"))
    if "store_server_errors" in options:
        options["store"] = AsyncKeyStore(store_server_errors=options.pop("store_server_errors"))
    return options


async def insert_payment(tx: Tx, amount: int = 1) -> int:
    cur = await tx.connection.execute(
        b"INSERT INTO payments (principal, amount, currency) VALUES ('test', %s, 'EUR')"
        b" RETURNING id",
        (amount,),
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


def with_cookie(payment: int) -> Response:
    """/cookie's answer: a 201 that sets a cookie (never to be replayed) and a custom header."""
    response = JSONResponse({"id": payment}, status_code=201)
    response.headers["Location"] = f"/payments/{payment}"
    response.headers["X-Custom"] = "kept"
    response.set_cookie("session", "secret-session-id")
    return response


async def hold(directory: str, payment: int, status: int) -> Response:
    """/block's wait: say "my write is done" with a file, then keep the transaction open until the
    test creates the gate file (or kills the server). Every run leaves a line in "runs"."""
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


def create_app() -> FastAPI:
    options = json.loads(os.environ.get("PGONCE_TEST_HTTP_OPTIONS") or "{}")
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"], **middleware_options(options))
    transaction = Depends(idempotent_transaction)

    @app.post("/boom")
    async def boom(tx: Tx = transaction) -> Response:
        await insert_payment(tx)
        raise RuntimeError("the endpoint failed after its write")

    @app.post("/fail")
    async def fail(tx: Tx = transaction) -> Response:
        await insert_payment(tx)
        return JSONResponse({"error": "upstream down"}, status_code=503)

    @app.post("/cookie")
    async def cookie(tx: Tx = transaction) -> Response:
        return with_cookie(await insert_payment(tx))

    @app.post("/stream")
    async def stream(chunks: int, size: int, tx: Tx = transaction) -> Response:
        payment = await insert_payment(tx)

        async def parts() -> AsyncIterator[bytes]:
            for index in range(chunks):
                yield f"{payment}:{index}:".encode().ljust(size, b".")

        return StreamingResponse(parts(), status_code=201, media_type="text/plain")

    @app.post("/empty")
    async def empty(tx: Tx = transaction) -> Response:
        await insert_payment(tx)
        return Response(status_code=204, headers={"x-custom": "kept"})

    @app.post("/no-db")
    async def no_db(tx: Tx = transaction) -> Response:
        tx.begin()
        return JSONResponse({"nonce": uuid.uuid4().hex}, status_code=201)

    @app.post("/untouched")
    async def untouched() -> Response:
        return JSONResponse({"nonce": uuid.uuid4().hex}, status_code=200)

    @app.post("/block")
    async def block(directory: str, status: int = 201, tx: Tx = transaction) -> Response:
        # Signals "my write is done" with a file, then holds the transaction open until the test
        # creates the gate file (or kills the server). Every run leaves a line in "runs". The
        # "backend" file, written before "started", names the PostgreSQL backend of the claim's
        # connection, so that a test can end exactly that one (psycopg knows it: no round trip).
        payment = await insert_payment(tx)
        (Path(directory) / "backend").write_text(str(tx.connection.info.backend_pid))
        return await hold(directory, payment, status)

    return app
