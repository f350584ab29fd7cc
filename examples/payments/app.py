"""Payments: a FastAPI app whose POST /payments is safe to retry with an Idempotency-Key.

Run it (PostgreSQL from ``PGONCE_DSN``, migrated with ``pgonce migrate``)::

    PGONCE_DSN=postgresql://... uvicorn --factory examples.payments.app:create_app

    curl -X POST localhost:8000/payments -H 'Authorization: Bearer alice-token' \\
         -H 'Idempotency-Key: "order-42"' -H 'Content-Type: application/json' \\
         -d '{"amount": 1000, "currency": "EUR"}'

Send the same request again: the answer is the same 201, byte for byte, marked
``Idempotent-Replayed: true``, and there is still one payment. What makes it exactly once: the
middleware claims the key in a transaction, the endpoint inserts the payment on *that*
transaction's connection, and the stored response commits with the payment.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, Field

from pgonce import Settings
from pgonce.http import IdempotencyMiddleware, IdempotentTransaction, idempotent_transaction
from pgonce.http.problem import problem_body

#: Demo credentials: bearer token -> principal. A real app asks its identity provider.
TOKENS = {"alice-token": "alice", "bob-token": "bob"}

CREATE_TABLE = b"""
CREATE TABLE IF NOT EXISTS payments (
    id         bigserial   PRIMARY KEY,
    principal  text        NOT NULL,
    amount     bigint      NOT NULL,
    currency   text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)
"""


def principal_of(authorization: str | None) -> str | None:
    """The principal a ``Bearer`` token names, or ``None``."""
    if not authorization or not authorization.startswith("Bearer "):
        return None
    return TOKENS.get(authorization.removeprefix("Bearer "))


def key_scope(scope: Mapping[str, Any]) -> str | None:
    """Keys belong to the authenticated principal: alice's key never meets bob's.

    ``None`` (no valid credentials) passes the request on without a claim: the app's own
    authentication answers 401 (``principal`` below), and an endpoint that asks for the claim's
    transaction first gets the middleware's 401, never a 500.
    """
    for name, value in scope["headers"]:
        if name == b"authorization":
            principal = principal_of(value.decode("latin-1"))
            return f"principal:{principal}" if principal else None
    return None


def principal(request: Request) -> str:
    found = principal_of(request.headers.get("authorization"))
    if found is None:
        raise HTTPException(401, "a valid bearer token is required")
    return found


class NewPayment(BaseModel):
    amount: int = Field(gt=0, description="in the currency's smallest unit")
    currency: str = Field(min_length=3, max_length=3)


async def invalid_request(request: Request, error: RequestValidationError) -> Response:
    """Say where and what, never echo the input: an RFC 9457 problem.

    FastAPI's own handler echoes the input back, and fails with a 500 on input it cannot
    serialize (NaN, Infinity).
    """
    problems = [
        {"loc": [str(part) for part in e.get("loc", ())], "msg": str(e.get("msg", ""))}
        for e in error.errors()
    ]
    return Response(
        problem_body(
            422, "Invalid request", "the body does not describe a payment", errors=problems
        ),
        status_code=422,
        media_type="application/problem+json",
    )


def create_app(dsn: str | None = None, **idempotency: Any) -> FastAPI:
    """The app on ``dsn`` (default: ``PGONCE_DSN``); ``idempotency`` tunes the middleware."""
    # pool_kwargs(): a request gets no connection within a second -> 503 + Retry-After (not
    # psycopg_pool's 30 s wait); lost connections are replaced by tries about a second apart, so
    # after a failover the app follows the new primary at once; no prepared statements behind a
    # transaction-mode pooler (PGONCE_POOLER).
    pool = AsyncConnectionPool(
        dsn or os.environ["PGONCE_DSN"],
        open=False,
        min_size=2,
        max_size=10,
        **Settings.from_env().pool_kwargs(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.open(wait=True)
        async with pool.connection() as conn:
            await conn.execute(CREATE_TABLE)
        yield
        await pool.close()

    app = FastAPI(title="payments", lifespan=lifespan)
    app.add_middleware(IdempotencyMiddleware, pool=pool, key_scope=key_scope, **idempotency)
    app.state.pool = pool

    app.add_exception_handler(RequestValidationError, invalid_request)  # type: ignore[arg-type]

    @app.post("/payments", status_code=201)
    async def create_payment(
        payment: NewPayment,
        who: Annotated[str, Depends(principal)],
        tx: Annotated[IdempotentTransaction, Depends(idempotent_transaction)],
    ) -> JSONResponse:
        # tx.connection is inside the claim's transaction: this row commits with the key.
        cur = await tx.connection.execute(
            b"INSERT INTO payments (principal, amount, currency) VALUES (%s, %s, %s)"
            b" RETURNING id, created_at",
            (who, payment.amount, payment.currency),
        )
        row = await cur.fetchone()
        assert row is not None
        body = {
            "id": row[0],
            "amount": payment.amount,
            "currency": payment.currency,
            "created_at": row[1].isoformat(),
        }
        return JSONResponse(body, status_code=201, headers={"Location": f"/payments/{row[0]}"})

    @app.get("/payments/{payment_id}")
    async def get_payment(payment_id: int, who: Annotated[str, Depends(principal)]) -> JSONResponse:
        async with pool.connection() as conn:
            cur = await conn.execute(
                b"SELECT id, amount, currency FROM payments WHERE id = %s AND principal = %s",
                (payment_id, who),
            )
            row = await cur.fetchone()
        if row is None:
            raise HTTPException(404, "no such payment")
        return JSONResponse({"id": row[0], "amount": row[1], "currency": row[2]})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"ok": True})

    return app


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(create_app(), port=int(os.environ.get("PORT", "8000")))
