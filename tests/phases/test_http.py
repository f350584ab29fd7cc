"""The ASGI middleware's two-phase routes: real PostgreSQL, a real fake provider, Starlette."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pgonce.errors import UsageError
from pgonce.http import IdempotencyMiddleware, header_scope, phased, transaction_of
from pgonce.testing import FakeProvider, charge


class Payments:
    """POST /payments in two-phase mode; its knobs let a test fail or hold one request."""

    def __init__(self, provider: FakeProvider) -> None:
        self.provider = provider
        self.fail_after_charge = 0
        self.hold: asyncio.Event | None = None
        self.holding = asyncio.Event()

    async def create(self, request: Request) -> Response:
        op = phased(request)
        body = json.loads(await request.body())

        async def record(conn: psycopg.AsyncConnection[Any]) -> int:
            cur = await conn.execute(
                "INSERT INTO payments (key, amount) VALUES (%s, %s) RETURNING id",
                (op.key, body["amount"]),
            )
            row = await cur.fetchone()
            assert row is not None
            return int(row[0])

        payment = await op.phase("create", record)
        if self.hold is not None:
            self.holding.set()
            await self.hold.wait()

        async def call(idempotency_key: str) -> dict[str, Any]:
            return await asyncio.to_thread(
                charge, self.provider.url, idempotency_key, payment=op.key, amount=body["amount"]
            )

        made = await op.call("charge", call)
        if self.fail_after_charge:
            self.fail_after_charge -= 1
            raise RuntimeError("the process died after the charge")
        return JSONResponse({"payment": payment, "charge": made["id"]}, status_code=201)


@asynccontextmanager
async def two_phase_client(
    dsn: str, endpoint: Callable[[Request], Awaitable[Response]], *, pool_size: int = 2
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of ``endpoint`` as POST /payments, a two-phase route of the ASGI middleware
    (callers named by ``x-api-key``), on a pool of the test's database."""
    app = Starlette(routes=[Route("/payments", endpoint, methods=["POST"])])
    async with AsyncConnectionPool(dsn, min_size=1, max_size=pool_size) as pool:
        wrapped = IdempotencyMiddleware(
            app, pool=pool, key_scope=header_scope("x-api-key"), two_phase=["/payments"]
        )
        transport = httpx.ASGITransport(app=wrapped, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


@pytest.fixture
async def setup(dsn: str) -> AsyncIterator[tuple[httpx.AsyncClient, Payments, FakeProvider]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE payments (id serial, key text UNIQUE, amount int)")
    with FakeProvider() as provider:
        payments = Payments(provider)
        async with two_phase_client(dsn, payments.create, pool_size=4) as client:
            yield client, payments, provider


def post(client: httpx.AsyncClient, key: str, amount: int = 42) -> Any:
    return client.post(
        "/payments",
        json={"amount": amount},
        headers={"idempotency-key": key, "x-api-key": "caller"},
    )


async def test_a_two_phase_answer_is_stored_and_replayed_byte_for_byte(
    setup: tuple[httpx.AsyncClient, Payments, FakeProvider],
) -> None:
    client, _, provider = setup
    first = await post(client, "k1")
    assert first.status_code == 201
    again = await post(client, "k1")
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert (await post(client, "k1", amount=43)).status_code == 422
    assert provider.charges_for("k1") == 1


async def test_a_failure_after_the_charge_resumes_from_the_recovery_point(
    setup: tuple[httpx.AsyncClient, Payments, FakeProvider], dsn: str
) -> None:
    client, payments, provider = setup
    payments.fail_after_charge = 1
    assert (await post(client, "k2")).status_code == 500
    retry = await post(client, "k2")
    assert retry.status_code == 201
    assert provider.charges_for("k2") == 1
    assert provider.requests == 1  # the charge was recorded: the retry did not call again
    with psycopg.connect(dsn, autocommit=True) as c:
        assert c.execute("SELECT count(*) FROM payments WHERE key = 'k2'").fetchone() == (1,)
    assert (await post(client, "k2")).content == retry.content


async def test_a_duplicate_while_the_holder_runs_is_in_flight(
    setup: tuple[httpx.AsyncClient, Payments, FakeProvider],
) -> None:
    client, payments, provider = setup
    payments.hold = asyncio.Event()
    first = asyncio.create_task(post(client, "k3"))
    await payments.holding.wait()
    duplicate = await post(client, "k3")
    assert duplicate.status_code == 409
    assert "retry-after" in duplicate.headers
    payments.hold.set()
    assert (await first).status_code == 201
    assert provider.charges_for("k3") == 1


async def test_asking_a_two_phase_request_for_its_transaction_names_the_phases(dsn: str) -> None:
    async def endpoint(request: Request) -> Response:
        try:
            transaction_of(request)
        except UsageError as error:
            return Response(str(error), status_code=400)
        return Response("a transaction", status_code=201)

    async with two_phase_client(dsn, endpoint) as client:
        answer = await post(client, "k-tx")
    assert answer.status_code == 400
    assert "two_phase route, which has no request transaction" in answer.text
    assert "phased(request)" in answer.text
