"""A two-phase answer too large to store, through real servers (uvicorn, and wsgiref for WSGI).

The phases ran before the answer was found too large: their recovery points (a charge at the
provider) are committed, and the key is kept for the retry that resumes them. The problem must
say so, not that nothing was done: a client told that would use a new key and pay twice.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import httpx
import psycopg
import pytest
import uvicorn
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pgonce.contrib.wsgi import IdempotencyMiddleware as WsgiMiddleware
from pgonce.contrib.wsgi import header_scope as wsgi_header_scope
from pgonce.contrib.wsgi import phased_of
from pgonce.http import IdempotencyMiddleware, header_scope, phased
from pgonce.testing import FakeProvider, charge

LIMIT = 1000
HEADERS = {"idempotency-key": "order-1", "x-api-key": "shop-1"}


@pytest.fixture
def provider(dsn: str) -> Iterator[FakeProvider]:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE payments (key text PRIMARY KEY, amount int)")
    with FakeProvider() as running:
        yield running


def asgi_app(dsn: str, provider: FakeProvider) -> Any:
    pool = AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False)

    async def create(request: Request) -> Response:
        op = phased(request)
        amount = json.loads(await request.body())["amount"]

        async def record(conn: psycopg.AsyncConnection[Any]) -> str:
            await conn.execute(
                "INSERT INTO payments (key, amount) VALUES (%s, %s)", (op.key, amount)
            )
            return op.key

        await op.phase("create", record)

        async def call(idempotency_key: str) -> dict[str, Any]:
            return await asyncio.to_thread(
                charge, provider.url, idempotency_key, payment=op.key, amount=amount
            )

        made = await op.call("charge", call)
        return Response(made["id"].encode() * LIMIT, status_code=201)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await pool.open(wait=True)
        try:
            yield
        finally:
            await pool.close()

    app = Starlette(routes=[Route("/payments", create, methods=["POST"])], lifespan=lifespan)
    return IdempotencyMiddleware(
        app,
        pool=pool,
        key_scope=header_scope("x-api-key"),
        two_phase=["/payments"],
        max_response_bytes=LIMIT,
    )


@pytest.fixture
def uvicorn_url(dsn: str, provider: FakeProvider) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)  # connections wait in the backlog until the server accepts them
    server = uvicorn.Server(
        uvicorn.Config(asgi_app(dsn, provider), log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
    assert not thread.is_alive()


def wsgi_app(provider: FakeProvider) -> Any:
    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        op = phased_of(environ)
        amount = json.loads(environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"])))["amount"]

        def record(conn: psycopg.Connection[Any]) -> str:
            conn.execute("INSERT INTO payments (key, amount) VALUES (%s, %s)", (op.key, amount))
            return op.key

        op.phase("create", record)
        made = op.call(
            "charge", lambda key: charge(provider.url, key, payment=op.key, amount=amount)
        )
        start_response("201 Created", [("content-type", "text/plain")])
        return [made["id"].encode() * LIMIT]

    return app


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def wsgi_url(dsn: str, provider: FakeProvider) -> Iterator[str]:
    with ConnectionPool(dsn, min_size=1, max_size=2) as pool:
        app = WsgiMiddleware(
            wsgi_app(provider),
            pool=pool,
            key_scope=wsgi_header_scope("X-Api-Key"),
            two_phase=["/payments"],
            max_response_bytes=LIMIT,
        )
        server: WSGIServer = make_server("127.0.0.1", 0, app, handler_class=_Quiet)
        thread = threading.Thread(target=server.serve_forever)
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_port}"
        finally:
            server.shutdown()
            thread.join(timeout=30)
            server.server_close()


def check_too_large_then_resumed(url: str, provider: FakeProvider, dsn: str) -> None:
    first = httpx.post(f"{url}/payments", json={"amount": 42}, headers=HEADERS, timeout=15)
    assert first.status_code == 500
    assert first.headers["content-type"] == "application/problem+json"
    problem = first.json()
    assert problem["title"] == "Response too large to store"
    detail = problem["detail"]
    assert "nothing was done" not in detail
    assert "same Idempotency-Key" in detail
    assert "never" in detail
    assert "new key" in detail
    assert provider.charges_for("order-1") == 1

    # The retry with the same key resumes from the recovery points: no second charge, no
    # second payment row; its answer is still too large, and is answered the same way.
    retry = httpx.post(f"{url}/payments", json={"amount": 42}, headers=HEADERS, timeout=15)
    assert retry.status_code == 500
    assert retry.json() == problem
    assert provider.charges_for("order-1") == 1
    with psycopg.connect(dsn, autocommit=True) as c:
        assert c.execute("SELECT count(*) FROM payments").fetchone() == (1,)


def test_asgi_too_large_says_the_work_resumes_with_the_same_key(
    uvicorn_url: str, provider: FakeProvider, dsn: str
) -> None:
    check_too_large_then_resumed(uvicorn_url, provider, dsn)


def test_wsgi_too_large_says_the_work_resumes_with_the_same_key(
    wsgi_url: str, provider: FakeProvider, dsn: str
) -> None:
    check_too_large_then_resumed(wsgi_url, provider, dsn)
