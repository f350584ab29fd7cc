"""What "Idempotency-Key on FastAPI / Starlette" promises beyond the conformance suite: an
endpoint's ``tx.fail()``, an ``HTTPException`` raised after writing, a compressing middleware
inside pgonce's, ``header_scope``'s digest, and a key scope that names no caller."""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import psycopg
import pytest
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from psycopg_pool import AsyncConnectionPool
from starlette.middleware.gzip import GZipMiddleware

from pgonce.http import (
    IdempotencyMiddleware,
    IdempotentTransaction,
    connection,
    header_scope,
    idempotent_transaction,
)
from tests.http.test_ended_transactions import asgi_client

Tx = IdempotentTransaction
transaction = Depends(idempotent_transaction)


def create_app(pool: AsyncConnectionPool[Any]) -> Any:
    app = FastAPI()

    async def write(conn: psycopg.AsyncConnection[Any], what: str) -> None:
        await conn.execute("INSERT INTO written VALUES (%s)", (what,))

    @app.post("/failed")
    async def failed(tx: Tx = transaction) -> JSONResponse:
        await write(tx.connection, "failed")
        tx.fail()  # the work failed although the endpoint answers
        return JSONResponse({"error": "declined"}, status_code=402)

    @app.post("/raised-after-writing")
    async def raised_after_writing(tx: Tx = transaction) -> None:
        await write(tx.connection, "raised")
        raise HTTPException(status_code=409, detail="conflict")

    @app.post("/failed-then-raised")
    async def failed_then_raised(tx: Tx = transaction) -> None:
        await write(tx.connection, "failed-then-raised")
        tx.fail()
        raise HTTPException(status_code=409, detail="conflict")

    @app.post("/large")
    async def large(request: Request) -> JSONResponse:
        await write(connection(request), "large")
        return JSONResponse({"text": "x" * 4000}, status_code=201)

    @app.post("/unscoped")
    async def unscoped(request: Request) -> JSONResponse:
        connection(request)  # a claim the middleware could not make
        return JSONResponse({}, status_code=201)

    app.add_middleware(GZipMiddleware, minimum_size=500)  # inside pgonce's: added first
    app.add_middleware(IdempotencyMiddleware, pool=pool, key_scope=header_scope("X-Api-Key"))
    return app


@pytest.fixture
async def client(dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE written (what text)")
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, open=False, min_size=1, max_size=2)
    async with asgi_client(create_app(pool), pool, base_url="http://api") as client:
        yield client


def stored(dsn: str) -> tuple[list[str], list[str]]:
    """The scopes of pgonce's keys, and what the endpoints wrote."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        scopes = [r[0] for r in conn.execute("SELECT scope FROM pgonce.keys")]
        written = [r[0] for r in conn.execute("SELECT what FROM written")]
    return scopes, written


def stored_body(dsn: str, key: str) -> bytes:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT response_body FROM pgonce.keys WHERE key = %s", (key,)
        ).fetchone()
    assert row is not None
    return bytes(row[0])


HEADERS = {"X-Api-Key": "client-a"}


async def test_a_failed_endpoint_answers_unstored_and_rolls_its_writes_back(
    client: httpx.AsyncClient, dsn: str
) -> None:
    headers = {**HEADERS, "Idempotency-Key": "k-failed"}
    first = await client.post("/failed", headers=headers)
    assert first.status_code == 402
    assert "idempotency-key-expires" not in first.headers
    assert stored(dsn) == ([], [])
    retry = await client.post("/failed", headers=headers)  # runs again: the key stayed free
    assert retry.status_code == 402
    assert "idempotent-replayed" not in retry.headers


async def test_an_http_exception_after_writing_is_stored_with_the_writes(
    client: httpx.AsyncClient, dsn: str
) -> None:
    headers = {**HEADERS, "Idempotency-Key": "k-raised"}
    first = await client.post("/raised-after-writing", headers=headers)
    assert first.status_code == 409
    assert stored(dsn)[1] == ["raised"]
    retry = await client.post("/raised-after-writing", headers=headers)
    assert retry.status_code == 409
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    assert stored(dsn)[1] == ["raised"]


async def test_fail_before_an_http_exception_keeps_it_out_of_the_store(
    client: httpx.AsyncClient, dsn: str
) -> None:
    headers = {**HEADERS, "Idempotency-Key": "k-failed-raised"}
    for _ in range(2):
        answer = await client.post("/failed-then-raised", headers=headers)
        assert answer.status_code == 409
        assert "idempotent-replayed" not in answer.headers
    assert stored(dsn) == ([], [])


async def test_a_compressed_answer_is_replayed_compressed_whatever_the_retry_accepts(
    client: httpx.AsyncClient, dsn: str
) -> None:
    key = {**HEADERS, "Idempotency-Key": "k-large"}
    first = await client.post("/large", headers={**key, "Accept-Encoding": "gzip"})
    assert first.status_code == 201
    assert first.headers["content-encoding"] == "gzip"
    retry = await client.post("/large", headers={**key, "Accept-Encoding": "identity"})
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.headers["content-encoding"] == "gzip"  # the stored bytes, as they were sent
    assert retry.content == first.content  # as httpx decoded both
    assert gzip.decompress(stored_body(dsn, "k-large")) == first.content


async def test_header_scope_stores_the_digest_of_the_header_not_its_value(
    client: httpx.AsyncClient, dsn: str
) -> None:
    answer = await client.post("/large", headers={**HEADERS, "Idempotency-Key": "k-scope"})
    assert answer.status_code == 201
    assert stored(dsn)[0] == [hashlib.sha256(b"client-a").hexdigest()]


async def test_an_endpoint_that_asks_for_the_claim_of_an_unscoped_request_is_401(
    client: httpx.AsyncClient, dsn: str
) -> None:
    answer = await client.post("/unscoped", headers={"Idempotency-Key": "k-anonymous"})
    assert answer.status_code == 401
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["title"] == "Authentication required"
    assert stored(dsn) == ([], [])
