"""A key scope that names the caller with something other than text, under uvicorn."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response
from psycopg_pool import AsyncConnectionPool

from pgonce.http import IdempotencyMiddleware, idempotent_transaction
from tests.http.app import Tx
from tests.http.conftest import ServerFactory, servers_of

APP = (sys.executable, "-m", "bench.servers", "{fd}", f"{__name__}:create_app")


def tenant_number(scope: Mapping[str, Any]) -> Any:
    """A tenant's number, not its name: the mistake under test."""
    return 42


async def async_tenant_number(scope: Mapping[str, Any]) -> Any:
    return 42


def create_app() -> FastAPI:
    pool = AsyncConnectionPool(os.environ["PGONCE_TEST_HTTP_DSN"], open=False, min_size=1)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with pool:
            yield

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(
        IdempotencyMiddleware, pool=pool, key_scope=tenant_number, routes={"/async": ()}
    )
    inner = FastAPI()
    inner.add_middleware(IdempotencyMiddleware, pool=pool, key_scope=async_tenant_number)
    app.mount("/async", inner)

    async def create(tx: Tx = Depends(idempotent_transaction)) -> Response:  # noqa: B008
        tx.begin()
        return JSONResponse({"ok": True}, status_code=201)

    app.post("/orders")(create)
    inner.post("/orders")(create)

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    return app


@pytest.fixture
def make_app(dsn: str, tmp_path: Path) -> Iterator[ServerFactory]:
    with servers_of(dsn, tmp_path, APP) as make:
        yield make


@pytest.mark.parametrize("path", ["/orders", "/async/orders"])
def test_a_key_scope_that_returns_no_text_is_a_usage_error(
    make_app: ServerFactory, path: str
) -> None:
    server = make_app()
    response = httpx.post(f"{server.url}{path}", headers={"Idempotency-Key": str(uuid.uuid4())})
    assert response.status_code == 500
    server.stop()
    log = server.log.read_text()
    assert "pgonce.errors.UsageError: key_scope returned int" in log, log
