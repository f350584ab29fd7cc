"""Real servers for the kit to judge: pgonce's example app, pgonce's test app, ``pgonce serve``,
and the deliberately broken receivers of :mod:`tests.conformance.broken`.

Every server runs in its own process on a loopback socket bound here (port 0) and stops at the
end of its test. The kit is run in-process against them, as a user's CI would run it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.http.conftest import Server, start_server

#: The payments example exactly as its docstring says to run it (PGONCE_DSN).
PAYMENTS = (sys.executable, "-m", "bench.servers", "{fd}", "examples.payments.app:create_app")
#: tests/http/app.py (the example plus /fail and /cookie) plus /slow: see tests/conformance/app.py.
APP = (sys.executable, "-m", "bench.servers", "{fd}", "tests.conformance.app:create_app")
BROKEN = (sys.executable, "-m", "bench.servers", "{fd}", "tests.conformance.broken:create_app")

#: The broken receivers' signing secret (a test value, Standard Webhooks form).
BROKEN_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

ALICE = {"Authorization": "Bearer alice-token"}
BOB = {"Authorization": "Bearer bob-token"}
PAYMENT = b'{"amount": 1000, "currency": "EUR"}'


@pytest.fixture
def payments_app(dsn: str, tmp_path: Path) -> Iterator[Server]:
    """examples/payments under uvicorn, on the test's own database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        from examples.payments.app import CREATE_TABLE

        conn.execute(CREATE_TABLE)  # the count query reads it before the app's first request
    server = start_server(dsn, tmp_path / "payments.log", {}, PAYMENTS, {"PGONCE_DSN": dsn})
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def test_app(dsn: str, tmp_path: Path) -> Iterator[Server]:
    """The payments example plus /fail, /cookie and /slow."""
    server = start_server(dsn, tmp_path / "test-app.log", {}, APP)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def broken(dsn: str, tmp_path: Path) -> Iterator[Server]:
    server = start_server(
        dsn, tmp_path / "broken.log", {}, BROKEN, {"BROKEN_SECRET": BROKEN_SECRET}
    )
    try:
        yield server
    finally:
        server.stop()
