"""A streaming response that never ends, under the Idempotency-Key middleware, served by uvicorn.

Its answer is decided once it exceeds ``max_response_bytes`` (the 500 problem, nothing kept): the
middleware must give that answer then, not read a stream that never ends while the client waits
and the key stays in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from fastapi import Depends, FastAPI
from fastapi.responses import Response, StreamingResponse

from examples.payments import app as payments
from pgonce.http import idempotent_transaction
from tests.http.app import Tx, insert_payment, middleware_options
from tests.http.conftest import ServerFactory, servers_of
from tests.http.test_probe_starlette_edges import payments_count

APP = (sys.executable, "-m", "bench.servers", "{fd}", f"{__name__}:create_app")


def create_app() -> FastAPI:
    options = json.loads(os.environ.get("PGONCE_TEST_HTTP_OPTIONS") or "{}")
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"], **middleware_options(options))

    @app.post("/events")
    async def events(tx: Tx = Depends(idempotent_transaction)) -> Response:  # noqa: B008
        await insert_payment(tx)

        async def ticks() -> AsyncIterator[bytes]:
            while True:
                yield b"data: tick\n\n" + b" " * 10_000
                await asyncio.sleep(0)

        return StreamingResponse(ticks(), media_type="text/event-stream")

    return app


@pytest.fixture
def make_app(dsn: str, tmp_path: Path) -> Iterator[ServerFactory]:
    with servers_of(dsn, tmp_path, APP) as make:
        yield make


def test_an_endless_stream_is_answered_too_large_and_frees_the_key(
    make_app: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = make_app(max_response_bytes=100_000)
    headers = {"Authorization": "Bearer alice-token", "Idempotency-Key": f'"{uuid.uuid4()}"'}
    before = payments_count(db)
    for _ in range(2):  # nothing kept: the retry runs again, and is answered the same
        response = httpx.post(f"{server.url}/events", headers=headers, timeout=15)
        assert response.status_code == 500
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["title"] == "Response too large to store"
        assert "idempotent-replayed" not in response.headers
    assert payments_count(db) == before
