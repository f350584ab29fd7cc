"""An endpoint that ends the request's transaction: pgonce never answers as if it stored the
response. Both cases are misuse (the endpoint owns its writes, the middleware the transaction),
and both are refused before anything of the request commits: the second's writes after the end,
in the transaction psycopg opened for them, are rolled back by the completion's guard."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import psycopg
import pytest
from fastapi import FastAPI, Request
from psycopg_pool import AsyncConnectionPool

from pgonce.http import IdempotencyMiddleware, connection


@pytest.fixture
async def client(dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE written (n int)")
    pool = AsyncConnectionPool(dsn, open=False, min_size=1, max_size=1)
    app = FastAPI()

    @app.post("/ended")
    async def ended(request: Request) -> dict[str, str]:
        await connection(request).rollback()
        return {}

    @app.post("/ended-then-written")
    async def ended_then_written(request: Request) -> dict[str, str]:
        conn = connection(request)
        await conn.rollback()
        await conn.execute("INSERT INTO written VALUES (1)")  # a transaction of its own
        return {}

    wrapped = IdempotencyMiddleware(app, pool=pool, key_scope=lambda scope: "s")
    async with asgi_client(wrapped, pool) as client:
        yield client


@asynccontextmanager
async def asgi_client(
    app: Any, pool: AsyncConnectionPool[Any], base_url: str = "http://test"
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of `app` in process, with `pool` open for as long as it is."""
    await pool.open()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=base_url) as client:
            yield client
    finally:
        await pool.close()


def stored(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM pgonce.keys), (SELECT count(*) FROM written)"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


async def test_an_ended_transaction_is_refused_before_anything_commits(
    client: httpx.AsyncClient, dsn: str
) -> None:
    answer = await client.post("/ended", headers={"Idempotency-Key": "k"})
    assert answer.status_code == 500
    assert answer.json()["title"] == "Transaction ended by the endpoint"
    assert stored(dsn) == (0, 0)


async def test_a_transaction_ended_and_written_anew_is_refused_before_anything_commits(
    client: httpx.AsyncClient, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="pgonce.http"):
        answer = await client.post("/ended-then-written", headers={"Idempotency-Key": "k"})
    # The endpoint's second transaction is rolled back with the failed completion: nothing of
    # the request committed, the client is told so, and its retry runs the work once, whole.
    assert answer.status_code == 500
    assert answer.json()["title"] == "Transaction ended by the endpoint"
    assert stored(dsn) == (0, 0)
    (record,) = [r for r in caplog.records if "a rollback had taken the claim" in r.getMessage()]
    assert record.levelno == logging.ERROR
