"""FastAPI + SQLAlchemy: the payments app with pgonce's Idempotency-Key middleware and without.

The same FastAPI app on SQLAlchemy's async ORM (POST /payments adds one ``Payment`` and answers
201 with JSON), one uvicorn process, an ``AsyncEngine`` on psycopg 3 with a pool of
:data:`POOL_SIZE`, loaded by the ASGI middleware workload's HTTP/1.1 client at the same
concurrency, each request with a new key:

- ``FastAPI + SQLAlchemy alone``: the reference; the endpoint's ``AsyncSession`` comes from a
  FastAPI dependency with yield (SQLAlchemy's and FastAPI's documented shape) and commits;
- ``FastAPI + SQLAlchemy + pgonce``: the middleware on ``EngineConnections(engine)``; the
  endpoint's session is ``idempotent_session``, on the middleware's connection, and flushes; the
  claim, the row and the stored response commit in one transaction;
- ``the key store's statements alone``: the same endpoint and session on the same
  ``EngineConnections(engine)``, between the key store's begin() and commit() with none of the
  middleware's logic (``bench.workloads.http_middleware.StatementsAlone``): what the claim and
  the stored response cost the app with the least Python around them, the limit of the target
  for any middleware on the one-transaction design.

Every variant's server runs throughout; in each round the variants take turns of half a second
(every other turn in the opposite order), so that a drift of the shared machine lands on all of
them alike. Each variant's best round is reported, and the target is also judged on the median over
the rounds of the ratio within a round.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Annotated, Any

import psycopg
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlalchemy import BigInteger, String
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from bench.context import BenchContext
from bench.pairs import (
    STATEMENTS,
    STATEMENTS_LABEL,
    alternate,
    cleanup_payments,
    compare,
    design_limit,
    prepare_payments,
)
from bench.pairs import VARIANTS as PAIR
from bench.report import Table, statements_alone
from bench.servers import serve_process
from bench.workloads.http_middleware import SLICE, StatementsAlone
from pgonce.contrib.sqlalchemy import EngineConnections, idempotent_session
from pgonce.http import IdempotencyMiddleware

TITLE = "FastAPI + SQLAlchemy: Idempotency-Key middleware on an AsyncEngine"

FACTORY = "bench.workloads.sqlalchemy_middleware:create_app"
VARIANTS = (*PAIR, STATEMENTS)
LABELS = {
    "none": "FastAPI + SQLAlchemy alone",
    "pgonce": "FastAPI + SQLAlchemy + pgonce",
    STATEMENTS: STATEMENTS_LABEL,
}
CONCURRENCY = 8
POOL_SIZE = 8
TABLE = "bench_sqlalchemy_payments"
SCOPE = "bench-sqlalchemy:bench"


class _Base(DeclarativeBase):
    pass


class Payment(_Base):
    __tablename__ = TABLE
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    principal: Mapped[str] = mapped_column(String)
    amount: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String)


class NewPayment(BaseModel):
    amount: int
    currency: str


async def plain_session(request: Request) -> AsyncIterator[AsyncSession]:
    """The reference's session: FastAPI's dependency with yield, on the app's engine."""
    async with AsyncSession(request.app.state.engine, expire_on_commit=False) as session:
        yield session


# Module level: FastAPI resolves the endpoints' (postponed) annotations in the module's namespace.
IdempotentSession = Annotated[AsyncSession, Depends(idempotent_session, scope="function")]
PlainSession = Annotated[AsyncSession, Depends(plain_session)]


def create_app() -> FastAPI:
    """The app for ``BENCH_SQLALCHEMY_VARIANT`` on ``BENCH_HTTP_DSN``."""
    variant = os.environ["BENCH_SQLALCHEMY_VARIANT"]
    dsn = os.environ["BENCH_HTTP_DSN"]

    async def connect() -> psycopg.AsyncConnection[Any]:
        return await psycopg.AsyncConnection.connect(dsn)

    engine = create_async_engine(
        "postgresql+psycopg://", async_creator=connect, pool_size=POOL_SIZE, max_overflow=0
    )
    app = FastAPI()
    app.state.engine = engine

    async def pay(session: AsyncSession, new: NewPayment, *, commit: bool) -> JSONResponse:
        payment = Payment(principal="bench", amount=new.amount, currency=new.currency)
        session.add(payment)
        await (session.commit() if commit else session.flush())
        body = {"id": payment.id, "amount": payment.amount, "currency": payment.currency}
        headers = {"Location": f"/payments/{payment.id}"}
        return JSONResponse(body, status_code=201, headers=headers)

    if variant in ("pgonce", STATEMENTS):
        if variant == STATEMENTS:
            app.add_middleware(StatementsAlone, pool=EngineConnections(engine), scope=SCOPE)
        else:
            app.add_middleware(
                IdempotencyMiddleware, pool=EngineConnections(engine), key_scope=lambda _: SCOPE
            )

        @app.post("/payments", status_code=201)
        async def create(new: NewPayment, session: IdempotentSession) -> JSONResponse:
            return await pay(session, new, commit=False)  # the middleware commits

    else:

        @app.post("/payments", status_code=201)
        async def create_plain(new: NewPayment, session: PlainSession) -> JSONResponse:
            return await pay(session, new, commit=True)

    return app


def run(ctx: BenchContext) -> list[Table]:
    prepare_payments(ctx.dsn, TABLE)
    log = Path(tempfile.gettempdir()) / "pgonce-bench-sqlalchemy.log"
    log.write_text("")
    rounds = 1 if ctx.quick else 5
    seconds = ctx.pick(5.0, short=4.0, quick=1.0)

    @contextlib.contextmanager
    def serve(variant: str) -> Iterator[tuple[list[int], list[int]]]:
        env = {"BENCH_SQLALCHEMY_VARIANT": variant, "BENCH_HTTP_DSN": ctx.dsn}
        with serve_process(FACTORY, env, log) as (port, pid):
            yield [port], [pid]

    runs, probes = alternate(
        VARIANTS, serve, ctx.dsn, rounds=rounds, seconds=seconds, concurrency=CONCURRENCY
    )
    cleanup_payments(ctx.dsn, ctx.schema, SCOPE, TABLE)
    notes = [
        f"One uvicorn process per variant, an AsyncEngine on psycopg 3 with a pool of "
        f"{POOL_SIZE}; {CONCURRENCY} keep-alive client connections, a new key on every request; "
        f"every variant's server running throughout, {rounds} round(s) of {seconds:g} s per "
        f"variant in turns of {SLICE:g} s interleaved across the variants, each variant's best "
        "round. Server CPU "
        "is the uvicorn process's; PostgreSQL CPU its backends on this database and its "
        "background processes, both per request over the measured round.",
        "With pgonce the request does more: BEGIN and the claim, the ORM's INSERT, the stored "
        "response and COMMIT in one transaction, against the session's INSERT and COMMIT.",
    ]
    tables = compare(TITLE, LABELS, runs, probes, notes)
    tables[0].notes.append(
        statements_alone(
            "an ASGI middleware",
            "the endpoint between the key store's begin() and commit(), its AsyncSession from "
            "idempotent_session on the claim's connection as under pgonce",
            LABELS["none"],
            LABELS["pgonce"],
        )
    )
    tables[1].notes.append(design_limit(LABELS, runs))
    return tables
