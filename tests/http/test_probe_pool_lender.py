"""A home-made pool whose plain ``def connection()`` returns the wrong thing: what it returns can
only be told when it is called, at the first covered request; then it is a UsageError naming the
pool's method, not a ``TypeError`` from ``with``/``async with``, nor a bare connection that
``with`` closes behind the pool's back. Served by real servers: uvicorn (ASGI) and wsgiref's
(WSGI, Flask's)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import httpx
import psycopg
import pytest
from fastapi import FastAPI

from pgonce.contrib import wsgi
from pgonce.errors import UsageError
from pgonce.http import IdempotencyMiddleware, header_scope
from tests.http.conftest import ServerFactory, servers_of

APP = (sys.executable, "-m", "bench.servers", "{fd}", f"{__name__}:create_app")
HEADERS = {"X-Api-Key": "shop"}


class CoroutineLender:
    """``def connection()`` that returns a coroutine (``AsyncConnection.connect()``'s), not a
    context manager."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def connection(self) -> Any:
        return psycopg.AsyncConnection.connect(self.dsn)


class SyncLender:
    """``def connection()`` that returns a sync context manager, to the ASGI middleware."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    def connection(self) -> Any:
        return psycopg.connect(self.dsn)


def create_app() -> FastAPI:
    dsn = os.environ["PGONCE_TEST_HTTP_DSN"]
    lender = json.loads(os.environ["PGONCE_TEST_HTTP_OPTIONS"])["lender"]
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/orders")
    async def orders() -> dict[str, bool]:
        return {"ok": True}

    pool = CoroutineLender(dsn) if lender == "coroutine" else SyncLender(dsn)
    return IdempotencyMiddleware(app, pool=pool, key_scope=header_scope("X-Api-Key"))  # type: ignore[return-value]


@pytest.fixture
def make_app(dsn: str, tmp_path: Path) -> Iterator[ServerFactory]:
    with servers_of(dsn, tmp_path, APP) as make:
        yield make


@pytest.mark.parametrize(
    ("lender", "named"),
    [("coroutine", "CoroutineLender.connection()"), ("sync", "SyncLender.connection()")],
)
def test_an_asgi_pool_lending_the_wrong_kind_is_named_at_the_request(
    make_app: ServerFactory, lender: str, named: str
) -> None:
    server = make_app(lender=lender)
    headers = {**HEADERS, "Idempotency-Key": f'"{uuid.uuid4()}"'}
    httpx.post(f"{server.url}/orders", json={}, headers=headers)
    server.stop()
    log = server.log.read_text()
    assert f"UsageError: {named} returned" in log, log
    assert "TypeError" not in log


class ConnectionLender:
    """``def connection()`` that returns a pooled connection itself (``getconn()``'s), which
    ``with`` would close at the end of the request: the pool would lend a closed one next."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def connection(self) -> Any:
        return self.conn


class AsyncLender:
    """``def connection()`` that returns an async context manager, to the WSGI middleware."""

    def connection(self) -> Any:
        @contextlib.asynccontextmanager
        async def lent() -> AsyncIterator[None]:
            yield None

        return lent()


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def ok(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    start_response("201 Created", [("Content-Type", "text/plain")])
    return [b"created"]


@contextlib.contextmanager
def serve(app: Any) -> Iterator[tuple[str, list[BaseException]]]:
    """``app`` served by wsgiref's server in a thread; what it raised, recorded."""
    raised: list[BaseException] = []

    def recording(environ: dict[str, Any], start_response: Any) -> Any:
        try:
            return app(environ, start_response)
        except Exception as error:
            raised.append(error)
            start_response("500 Internal Server Error", [], sys.exc_info())
            return [b""]

    server = make_server("127.0.0.1", 0, recording, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", raised
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_wsgi_pool_lending_a_bare_connection_is_named_and_the_connection_kept(
    dsn: str,
) -> None:
    with psycopg.connect(dsn) as conn:
        pool = ConnectionLender(conn)
        app = wsgi.IdempotencyMiddleware(ok, pool=pool, key_scope=wsgi.header_scope("X-Api-Key"))
        with serve(app) as (url, raised):
            headers = {**HEADERS, "Idempotency-Key": "k"}
            httpx.post(f"{url}/orders", content=b"{}", headers=headers)
        assert [type(error) for error in raised] == [UsageError]
        assert "ConnectionLender.connection() returned a connection" in str(raised[0])
        assert not conn.closed


def test_a_wsgi_pool_lending_an_async_context_manager_is_named(dsn: str) -> None:
    app = wsgi.IdempotencyMiddleware(
        ok, pool=AsyncLender(), key_scope=wsgi.header_scope("X-Api-Key")
    )
    with serve(app) as (url, raised):
        headers = {**HEADERS, "Idempotency-Key": "k"}
        httpx.post(f"{url}/orders", content=b"{}", headers=headers)
    assert [type(error) for error in raised] == [UsageError]
    assert "AsyncLender.connection() returned _AsyncGeneratorContextManager" in str(raised[0])


class AsyncDefLender:
    async def connection(self) -> Any:
        raise AssertionError("not called at set-up")


@pytest.mark.parametrize("kind", ["asgi", "wsgi"])
def test_an_async_def_connection_is_refused_at_set_up(kind: str) -> None:
    with pytest.raises(UsageError, match="pool must be"):
        if kind == "asgi":
            IdempotencyMiddleware(FastAPI(), pool=AsyncDefLender(), key_scope=lambda s: "t")  # type: ignore[arg-type]
        else:
            wsgi.IdempotencyMiddleware(ok, pool=AsyncDefLender(), key_scope=lambda e: "t")  # type: ignore[arg-type]
