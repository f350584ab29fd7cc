"""A generator WSGI application that asks for the claim on an unscoped request is answered 401.

A request with an Idempotency-Key whose key scope names no caller runs without a claim, and an
application that asks for the claim's transaction gets the 401 problem. A generator application
runs only when the server iterates its body, after the middleware returned: its MissingKeyScope
reached the server, which answered 500. Served by a real WSGI server (wsgiref's) in a thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from psycopg_pool import ConnectionPool

from pgonce.contrib.wsgi import IdempotencyMiddleware, header_scope, transaction_of
from tests.flask.test_probe_wsgi_sqlalchemy_unavailable import serve


def lazy(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
    transaction_of(environ)
    start_response("201 Created", [("Content-Type", "text/plain")])
    yield b"created"


@pytest.fixture
def base_url(dsn: str) -> Iterator[str]:
    with ConnectionPool(dsn, min_size=1, max_size=2) as pool:
        app = IdempotencyMiddleware(lazy, pool=pool, key_scope=header_scope("X-Api-Key"))
        with serve(app) as url:
            yield url


def test_a_generator_application_asking_for_the_claim_unscoped_is_a_401(base_url: str) -> None:
    answer = httpx.post(base_url + "/orders", headers={"Idempotency-Key": "k"}, content=b"{}")
    assert answer.status_code == 401
    assert answer.headers["Content-Type"] == "application/problem+json"


def test_a_scoped_request_runs_the_generator_application(base_url: str) -> None:
    headers = {"Idempotency-Key": "k", "X-Api-Key": "shop"}
    answer = httpx.post(base_url + "/orders", headers=headers, content=b"{}")
    assert (answer.status_code, answer.content) == (201, b"created")
