"""FastAPI features around the Idempotency-Key middleware, through a real uvicorn server."""

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
from fastapi import BackgroundTasks, Depends, FastAPI
from fastapi.responses import JSONResponse, Response

from examples.payments import app as payments
from pgonce.http import idempotent_transaction
from tests.http.app import Tx, insert_payment, middleware_options
from tests.http.conftest import Server, ServerFactory, servers_of

APP = (
    sys.executable,
    "-m",
    "bench.servers",
    "{fd}",
    "tests.http.test_probe_starlette_edges:create_app",
)
HEADERS = {"Authorization": "Bearer alice-token"}


def create_app() -> FastAPI:
    options = json.loads(os.environ.get("PGONCE_TEST_HTTP_OPTIONS") or "{}")
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"], **middleware_options(options))
    transaction = Depends(idempotent_transaction)

    def fail_later(directory: str) -> None:
        (Path(directory) / "ran").write_text("yes")
        raise RuntimeError("the background task failed")

    @app.post("/background-fails")
    async def background_fails(
        directory: str, tasks: BackgroundTasks, tx: Tx = transaction
    ) -> Response:
        payment = await insert_payment(tx)
        tasks.add_task(fail_later, directory)
        return JSONResponse({"id": payment}, status_code=201)

    return app


@pytest.fixture
def make_app(dsn: str, tmp_path: Path) -> Iterator[ServerFactory]:
    with servers_of(dsn, tmp_path, APP) as make:
        yield make


def payments_count(db: psycopg.Connection[Any]) -> int:
    row = db.execute("SELECT count(*) FROM payments").fetchone()
    assert row is not None
    return int(row[0])


def test_a_background_task_that_fails_after_the_answer_is_no_success(
    make_app: ServerFactory, db: psycopg.Connection[Any], tmp_path: Path
) -> None:
    """The task runs after the endpoint answered and raises: the request's transaction rolls
    back, so the client must not get the endpoint's 201 for a payment that never committed."""
    server: Server = make_app()
    before = payments_count(db)
    headers = {**HEADERS, "Idempotency-Key": f'"{uuid.uuid4()}"'}
    url = f"{server.url}/background-fails"
    response = httpx.post(url, params={"directory": str(tmp_path)}, headers=headers)
    assert (tmp_path / "ran").exists()
    assert response.status_code == 500
    assert payments_count(db) == before
    # Nothing was stored and the key is free: the retry runs again.
    (tmp_path / "ran").unlink()
    again = httpx.post(url, params={"directory": str(tmp_path)}, headers=headers)
    assert again.status_code == 500
    assert "idempotent-replayed" not in again.headers
    assert (tmp_path / "ran").exists()
