"""An endpoint that commits or rolls back the request's transaction itself, under the ASGI
middleware served by uvicorn: answered as the WSGI and Django adapters answer it.

Committed, the claim went with the endpoint's writes before the response was stored: the
response is stored just after, so the key is not left in flight (every retry answered 409 until
the key expired, for work that was done). Rolled back, nothing of the request committed: the
client gets the "Transaction ended by the endpoint" problem, never the server's bare 500, and
the retry runs. Either way the log names the error.
"""

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

APP = (sys.executable, "-m", "bench.servers", "{fd}", f"{__name__}:create_app")


def create_app() -> FastAPI:
    options = json.loads(os.environ.get("PGONCE_TEST_HTTP_OPTIONS") or "{}")
    app = payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"], **middleware_options(options))

    @app.post("/committed")
    async def committed(tx: Tx = Depends(idempotent_transaction)) -> Response:  # noqa: B008
        payment = await insert_payment(tx)
        await tx.connection.commit()
        return JSONResponse({"id": payment}, status_code=201)

    @app.post("/rolled-back")
    async def rolled_back(tx: Tx = Depends(idempotent_transaction)) -> Response:  # noqa: B008
        payment = await insert_payment(tx)
        await tx.connection.rollback()
        return JSONResponse({"id": payment}, status_code=201)

    return app


@pytest.fixture
def make_app(dsn: str, tmp_path: Path) -> Iterator[ServerFactory]:
    with servers_of(dsn, tmp_path, APP) as make:
        yield make


def headers() -> dict[str, str]:
    return {"Authorization": "Bearer alice-token", "Idempotency-Key": str(uuid.uuid4())}


def test_a_commit_by_the_endpoint_stores_its_answer_and_leaves_no_key_in_flight(
    make_app: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = make_app()
    sent = headers()
    before = payments_count(db)
    first = httpx.post(f"{server.url}/committed", headers=sent, timeout=15)
    again = httpx.post(f"{server.url}/committed", headers=sent, timeout=15)
    assert first.status_code == again.status_code == 201
    assert "idempotency-key-expires" in first.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert payments_count(db) == before + 1
    log = server.log.read_text()
    assert "transaction ended by its endpoint" in log
    assert "Traceback" not in log


def test_a_rollback_by_the_endpoint_is_a_problem_and_frees_the_key(
    make_app: ServerFactory, db: psycopg.Connection[Any]
) -> None:
    server = make_app()
    sent = headers()
    before = payments_count(db)
    for _ in range(2):  # nothing kept: the retry runs again, and is answered the same
        answer = httpx.post(f"{server.url}/rolled-back", headers=sent, timeout=15)
        assert answer.status_code == 500
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["title"] == "Transaction ended by the endpoint"
    assert payments_count(db) == before
    assert "Traceback" not in server.log.read_text()
