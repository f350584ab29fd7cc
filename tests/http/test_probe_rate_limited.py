"""A 429 (a rate limit that refused the request, after it read or wrote the database) under the
Idempotency-Key middleware, through a real uvicorn server: never stored for replay."""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response

from examples.payments import app as payments
from pgonce.http import idempotent_transaction
from tests.http.app import Tx, insert_payment, middleware_options
from tests.http.conftest import ServerFactory, servers_of
from tests.http.test_probe_starlette_edges import payments_count

APP = (
    sys.executable,
    "-m",
    "bench.servers",
    "{fd}",
    "tests.http.test_probe_rate_limited:create_app",
)
HEADERS = {"Authorization": "Bearer alice-token"}


def create_app() -> FastAPI:
    options = json.loads(os.environ.get("PGONCE_TEST_HTTP_OPTIONS") or "{}")
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"], **middleware_options(options))
    transaction = Depends(idempotent_transaction)

    @app.post("/throttled")
    async def throttled(directory: str, tx: Tx = transaction) -> Response:
        """A limiter that counts the caller's requests in the database, then refuses while the
        gate file is absent, and lets the request through once it is there."""
        payment = await insert_payment(tx)
        if not (Path(directory) / "gate").exists():
            return JSONResponse(
                {"error": "rate limited"}, status_code=429, headers={"Retry-After": "1"}
            )
        return JSONResponse({"id": payment}, status_code=201)

    return app


@pytest.fixture
def make_app(dsn: str, tmp_path: Path) -> Iterator[ServerFactory]:
    with servers_of(dsn, tmp_path, APP) as make:
        yield make


@pytest.mark.parametrize("store_server_errors", [False, True])
def test_a_429_is_not_stored_and_the_retry_runs(
    make_app: ServerFactory,
    db: psycopg.Connection[Any],
    tmp_path: Path,
    store_server_errors: bool,
) -> None:
    server = make_app(store_server_errors=store_server_errors)
    before = payments_count(db)
    headers = {**HEADERS, "Idempotency-Key": f'"{uuid.uuid4()}"'}
    url = f"{server.url}/throttled"
    params = {"directory": str(tmp_path)}

    refused = httpx.post(url, params=params, headers=headers)
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"
    assert "idempotency-key-expires" not in refused.headers
    # Rolled back with the limiter's write, and the key is free.
    assert payments_count(db) == before
    again = httpx.post(url, params=params, headers=headers)
    assert again.status_code == 429
    assert "idempotent-replayed" not in again.headers

    # The retry after Retry-After runs the work, and that answer is the one stored.
    (tmp_path / "gate").write_text("open")
    done = httpx.post(url, params=params, headers=headers)
    assert done.status_code == 201, done.text
    assert "idempotent-replayed" not in done.headers
    assert payments_count(db) == before + 1
    replayed = httpx.post(url, params=params, headers=headers)
    assert replayed.status_code == 201
    assert replayed.headers["idempotent-replayed"] == "true"
    assert replayed.content == done.content
    assert payments_count(db) == before + 1
