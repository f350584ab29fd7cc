"""Payments on FastAPI and SQLAlchemy's async ORM: POST /payments is safe to retry.

Run it (PostgreSQL from ``PGONCE_DSN``, migrated with ``pgonce migrate``)::

    PGONCE_DSN=postgresql://... uvicorn --factory examples.sqlalchemy_payments.app:create_app

    curl -X POST localhost:8000/payments -H 'Authorization: Bearer alice-token' \\
         -H 'Idempotency-Key: "order-42"' -H 'Content-Type: application/json' \\
         -d '{"amount": 1000, "currency": "EUR"}'

Send the same request again: the same 201, byte for byte, marked ``Idempotent-Replayed: true``,
one payment and one ``payment.created`` event. What makes it exactly once: the middleware takes
its connection from the SQLAlchemy engine's pool and claims the key in a transaction on it; the
endpoint's ``AsyncSession`` writes on that same connection and transaction (the ORM insert and
the outbox event), and the stored response commits with them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Annotated, Any

import psycopg
from fastapi import Depends, FastAPI, HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import BigInteger, DateTime, String, func, select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from examples.payments.app import NewPayment, invalid_request, key_scope, principal
from pgonce.contrib.sqlalchemy import EngineConnections, async_enqueue, idempotent_session
from pgonce.http import IdempotencyMiddleware


class Base(DeclarativeBase):
    pass


class Payment(Base):
    __tablename__ = "payments"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    principal: Mapped[str] = mapped_column(String)
    amount: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


#: The endpoint's session: on the idempotent request's connection and transaction. Ended with the
#: endpoint function (``scope="function"``), so that its last flush happens before the answer.
IdempotentSession = Annotated[AsyncSession, Depends(idempotent_session, scope="function")]


def engine_for(dsn: str) -> AsyncEngine:
    """An engine on psycopg 3 for a libpq DSN (URL or ``key=value``)."""

    async def connect() -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(dsn)

    return create_async_engine(
        "postgresql+psycopg://", async_creator=connect, pool_size=10, max_overflow=0
    )


def create_app(dsn: str | None = None, **idempotency: Any) -> FastAPI:
    """The app on ``dsn`` (default: ``PGONCE_DSN``); ``idempotency`` tunes the middleware."""
    engine = engine_for(dsn or os.environ["PGONCE_DSN"])

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        yield
        await engine.dispose()

    app = FastAPI(title="payments (SQLAlchemy)", lifespan=lifespan)
    app.add_middleware(
        IdempotencyMiddleware, pool=EngineConnections(engine), key_scope=key_scope, **idempotency
    )
    app.state.engine = engine

    app.add_exception_handler(RequestValidationError, invalid_request)  # type: ignore[arg-type]

    @app.post("/payments", status_code=201)
    async def create_payment(
        new: NewPayment, who: Annotated[str, Depends(principal)], session: IdempotentSession
    ) -> JSONResponse:
        payment = Payment(principal=who, amount=new.amount, currency=new.currency)
        session.add(payment)
        await session.flush()  # not commit(): the middleware commits once the answer is stored
        await session.refresh(payment, ["created_at"])
        body = {
            "id": payment.id,
            "amount": payment.amount,
            "currency": payment.currency,
            "created_at": payment.created_at.isoformat(),
        }
        await async_enqueue(session, "payment", str(payment.id), "payment.created", body)
        return JSONResponse(body, status_code=201, headers={"Location": f"/payments/{payment.id}"})

    @app.get("/payments/{payment_id}")
    async def get_payment(payment_id: int, who: Annotated[str, Depends(principal)]) -> JSONResponse:
        async with AsyncSession(engine) as session:
            payment = await session.scalar(
                select(Payment).where(Payment.id == payment_id, Payment.principal == who)
            )
        if payment is None:
            raise HTTPException(404, "no such payment")
        return JSONResponse(
            {"id": payment.id, "amount": payment.amount, "currency": payment.currency}
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"ok": True})

    return app


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(create_app(), port=int(os.environ.get("PORT", "8000")), factory=False)
