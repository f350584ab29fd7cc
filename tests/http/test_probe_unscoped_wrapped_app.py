"""A request whose key scope names no caller, under a middleware that wraps the whole Starlette
application (``IdempotencyMiddleware(Starlette(...))``, as the two-phase page shows it) rather
than one added with ``add_middleware()``: Starlette's error middleware is then inside pgonce's and
answers the endpoint's ``MissingKeyScope`` with its 500 before raising it. The client must get the
401 all the same, and an endpoint's own 5xx must still reach it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pgonce.http import IdempotencyMiddleware, connection, header_scope, phased


async def one(request: Request) -> Response:
    connection(request)
    return JSONResponse({}, status_code=201)


async def two(request: Request) -> Response:
    phased(request)
    return JSONResponse({}, status_code=201)


async def unavailable(request: Request) -> Response:
    return JSONResponse({"down": True}, status_code=503)


async def broken(request: Request) -> Response:
    raise RuntimeError("the endpoint's own failure")


@pytest.fixture
async def client(dsn: str) -> AsyncIterator[httpx.AsyncClient]:
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(dsn, open=False, min_size=1, max_size=2)
    await pool.open()
    routes = [
        Route("/one", one, methods=["POST"]),
        Route("/two", two, methods=["POST"]),
        Route("/unavailable", unavailable, methods=["POST"]),
        Route("/broken", broken, methods=["POST"]),
    ]
    app = IdempotencyMiddleware(
        Starlette(routes=routes),
        pool=pool,
        key_scope=header_scope("X-Api-Key"),
        two_phase=["/two"],
    )
    try:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            yield client
    finally:
        await pool.close()


@pytest.mark.parametrize("path", ["/one", "/two"])
async def test_a_claim_asked_for_without_a_caller_is_401_not_starlettes_500(
    client: httpx.AsyncClient, path: str
) -> None:
    answer = await client.post(path, headers={"Idempotency-Key": "k-anonymous"})
    assert answer.status_code == 401, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["title"] == "Authentication required"


async def test_an_unscoped_endpoints_own_5xx_reaches_the_client(
    client: httpx.AsyncClient,
) -> None:
    answer = await client.post("/unavailable", headers={"Idempotency-Key": "k-503"})
    assert answer.status_code == 503
    assert answer.json() == {"down": True}
    failed = await client.post("/broken", headers={"Idempotency-Key": "k-500"})
    assert failed.status_code == 500
