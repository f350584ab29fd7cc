"""A payments app mounted under another, whose lifespan (which opens the pool) never runs."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from examples.payments import app as payments
from tests.http.conftest import ServerFactory, servers_of

APP = (sys.executable, "-m", "bench.servers", "{fd}", f"{__name__}:create_app")


def create_app() -> FastAPI:
    outer = FastAPI()
    outer.mount("/api", payments.create_app(os.environ["PGONCE_TEST_HTTP_DSN"]))

    @outer.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    return outer


@pytest.fixture
def make_app(dsn: str, tmp_path: Path) -> Iterator[ServerFactory]:
    with servers_of(dsn, tmp_path, APP) as make:
        yield make


def test_a_pool_never_opened_is_named_in_the_log_not_only_answered_503(
    make_app: ServerFactory,
) -> None:
    server = make_app()
    headers = {"Authorization": "Bearer alice-token", "Idempotency-Key": f'"{uuid.uuid4()}"'}
    response = httpx.post(
        f"{server.url}/api/payments", json={"amount": 5, "currency": "EUR"}, headers=headers
    )
    # The documented answer for a database that cannot be reached...
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    server.stop()
    # ...and a log line that names the cause, which no retry will cure.
    assert "connection pool is not open" in server.log.read_text()
