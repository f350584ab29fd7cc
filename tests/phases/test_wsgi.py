"""The WSGI adapter's two-phase routes: the same answers as the ASGI middleware's."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import psycopg
import pytest
from psycopg_pool import ConnectionPool

from pgonce.contrib.wsgi import IdempotencyMiddleware, header_scope, phased_of
from pgonce.testing import FakeProvider, charge

Environ = dict[str, Any]


def payments_app(provider: FakeProvider, failures: list[int]) -> Any:
    def app(environ: Environ, start_response: Any) -> Iterable[bytes]:
        op = phased_of(environ)
        amount = json.loads(environ["wsgi.input"].read())["amount"]

        def record(conn: psycopg.Connection[Any]) -> str:
            conn.execute("INSERT INTO payments (key, amount) VALUES (%s, %s)", (op.key, amount))
            return op.key

        op.phase("create", record)
        made = op.call(
            "charge", lambda key: charge(provider.url, key, payment=op.key, amount=amount)
        )
        if failures:
            failures.pop()
            raise RuntimeError("died after the charge")
        body = json.dumps({"charge": made["id"]}).encode()
        start_response("201 Created", [("content-type", "application/json")])
        return [body]

    return app


@pytest.fixture
def client(dsn: str) -> Iterator[tuple[httpx.Client, FakeProvider, list[int]]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE payments (key text PRIMARY KEY, amount int)")
    failures: list[int] = []
    with FakeProvider() as provider, ConnectionPool(dsn, min_size=1, max_size=2) as pool:
        app = IdempotencyMiddleware(
            payments_app(provider, failures),
            pool=pool,
            key_scope=header_scope("X-Api-Key"),
            two_phase=["/payments"],
        )
        transport = httpx.WSGITransport(app=app)
        with httpx.Client(transport=transport, base_url="http://shop") as http:
            yield http, provider, failures


def post(http: httpx.Client, key: str) -> httpx.Response:
    headers = {"idempotency-key": key, "x-api-key": "shop-1"}
    return http.post("/payments", json={"amount": 42}, headers=headers)


def test_stored_replayed_and_resumed_after_a_failure(
    client: tuple[httpx.Client, FakeProvider, list[int]],
) -> None:
    http, provider, failures = client
    first = post(http, "w1")
    assert first.status_code == 201
    again = post(http, "w1")
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"

    failures.append(1)
    with pytest.raises(RuntimeError):  # the server would answer 500
        post(http, "w2")
    retry = post(http, "w2")
    assert retry.status_code == 201
    assert provider.charged() == {"w1": 1, "w2": 1}
    assert provider.requests == 2  # the failed request's charge was recorded: not called again
