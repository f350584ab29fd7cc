"""pgonce's test app (tests/http/app.py) plus ``POST /slow``, an endpoint that takes a while.

The kit's in-flight check needs a request that is still running when its retry arrives; a real
endpoint that calls a payment provider takes that long. Started like the test app, with the
database in ``PGONCE_TEST_HTTP_DSN``.
"""

from __future__ import annotations

import asyncio

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response

from pgonce.http import IdempotentTransaction, idempotent_transaction
from tests.http import app as test_app

#: How long /slow works, in seconds, with the claim and its payment row held in its transaction.
SLOW_SECONDS = 1.0


def create_app() -> FastAPI:
    app = test_app.create_app()

    @app.post("/slow")
    async def slow(
        tx: IdempotentTransaction = Depends(idempotent_transaction),  # noqa: B008
    ) -> Response:
        payment = await test_app.insert_payment(tx)
        await asyncio.sleep(SLOW_SECONDS)  # a call to a slow upstream, inside the transaction
        return JSONResponse({"id": payment}, status_code=201)

    return app
