"""A duplicate on a two-phase route waits (bounded) for the holder's answer: ASGI and WSGI.

The same ``wait`` that lets a one-transaction duplicate wait on the original's row lock lets a
two-phase duplicate look at the key again until the holder stored its answer: then it replays
it, takes over a holder that failed, or after ``wait`` is answered 409. The tests hold the
original on an event, and count the duplicate's looks through the phase store it is given.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool
from starlette.applications import Starlette
from starlette.routing import Route

from pgonce.contrib import wsgi
from pgonce.http import IdempotencyMiddleware, header_scope
from pgonce.phases import AsyncPhasedOperation, AsyncPhaseStore, PhasedOperation, PhaseStore
from pgonce.testing import FakeProvider, charge
from tests.phases.test_http import Payments, post

LONG = timedelta(seconds=10)
SHORT = timedelta(milliseconds=300)


class WatchedStore(AsyncPhaseStore):
    """The middleware's phase store, counting the claims that came back in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.looked = asyncio.Event()

    async def start(self, *args: Any, **kwargs: Any) -> AsyncPhasedOperation[Any]:
        op = await super().start(*args, **kwargs)
        if op.in_flight:
            self.in_flight += 1
            self.looked.set()
        return op


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with FakeProvider() as fake:
        yield fake


@pytest.fixture
async def asgi(
    dsn: str, provider: FakeProvider, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[httpx.AsyncClient, Payments, WatchedStore]]:
    wait: timedelta = request.param
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE payments (id serial, key text UNIQUE, amount int)")
    payments = Payments(provider)
    store = WatchedStore()
    app = Starlette(routes=[Route("/payments", payments.create, methods=["POST"])])
    async with AsyncConnectionPool(dsn, min_size=2, max_size=4) as pool:
        wrapped = IdempotencyMiddleware(
            app,
            pool=pool,
            key_scope=header_scope("x-api-key"),
            two_phase=["/payments"],
            wait=wait,
            phases=store,
        )
        transport = httpx.ASGITransport(app=wrapped, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, payments, store


@pytest.mark.parametrize("asgi", [LONG], indirect=True)
async def test_asgi_a_duplicate_waits_for_the_holder_and_replays_its_answer(
    asgi: tuple[httpx.AsyncClient, Payments, WatchedStore], provider: FakeProvider
) -> None:
    client, payments, store = asgi
    payments.hold = asyncio.Event()
    first = asyncio.create_task(post(client, "w1"))
    await payments.holding.wait()
    duplicate = asyncio.create_task(post(client, "w1"))
    await store.looked.wait()  # the duplicate found the key in flight, and waits
    payments.hold.set()
    original = await first
    again = await duplicate
    assert original.status_code == 201
    assert again.status_code == 201
    assert again.content == original.content
    assert again.headers["idempotent-replayed"] == "true"
    assert provider.charges_for("w1") == 1


@pytest.mark.parametrize("asgi", [LONG], indirect=True)
async def test_asgi_a_duplicate_takes_over_a_holder_that_failed_while_it_waited(
    asgi: tuple[httpx.AsyncClient, Payments, WatchedStore], provider: FakeProvider
) -> None:
    client, payments, store = asgi
    payments.hold = asyncio.Event()
    payments.fail_after_charge = 1
    first = asyncio.create_task(post(client, "w2"))
    await payments.holding.wait()
    duplicate = asyncio.create_task(post(client, "w2"))
    await store.looked.wait()
    payments.hold.set()
    assert (await first).status_code == 500  # charged, then failed: the lease ends
    again = await duplicate
    assert again.status_code == 201  # resumed from the recovery point
    assert "idempotent-replayed" not in again.headers
    assert provider.charges_for("w2") == 1
    assert provider.requests == 1


@pytest.mark.parametrize("asgi", [SHORT], indirect=True)
async def test_asgi_a_duplicate_is_answered_in_flight_once_its_wait_is_over(
    asgi: tuple[httpx.AsyncClient, Payments, WatchedStore], provider: FakeProvider
) -> None:
    client, payments, store = asgi
    payments.hold = asyncio.Event()
    first = asyncio.create_task(post(client, "w3"))
    await payments.holding.wait()
    duplicate = await post(client, "w3")
    assert duplicate.status_code == 409
    assert duplicate.headers["retry-after"] == "1"
    assert store.in_flight > 1  # it looked again before giving up
    payments.hold.set()
    assert (await first).status_code == 201
    assert provider.charges_for("w3") == 1


class WatchedSyncStore(PhaseStore):
    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.looked = threading.Event()

    def start(self, *args: Any, **kwargs: Any) -> PhasedOperation[Any]:
        op = super().start(*args, **kwargs)
        if op.in_flight:
            self.in_flight += 1
            self.looked.set()
        return op


@pytest.fixture
def wsgi_setup(
    dsn: str, provider: FakeProvider, request: pytest.FixtureRequest
) -> Iterator[tuple[httpx.Client, WatchedSyncStore, threading.Event, threading.Event]]:
    wait: timedelta = request.param
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("CREATE TABLE payments (key text PRIMARY KEY, amount int)")
    holding, hold = threading.Event(), threading.Event()

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        op = wsgi.phased_of(environ)
        amount = json.loads(environ["wsgi.input"].read())["amount"]

        def record(conn: psycopg.Connection[Any]) -> str:
            conn.execute("INSERT INTO payments (key, amount) VALUES (%s, %s)", (op.key, amount))
            return op.key

        op.phase("create", record)
        holding.set()
        assert hold.wait(timeout=30)
        made = op.call(
            "charge", lambda key: charge(provider.url, key, payment=op.key, amount=amount)
        )
        start_response("201 Created", [("content-type", "application/json")])
        return [json.dumps({"charge": made["id"]}).encode()]

    store = WatchedSyncStore()
    with ConnectionPool(dsn, min_size=2, max_size=3) as pool:
        wrapped = wsgi.IdempotencyMiddleware(
            app,
            pool=pool,
            key_scope=wsgi.header_scope("X-Api-Key"),
            two_phase=["/payments"],
            wait=wait,
            phases=store,
        )
        with httpx.Client(transport=httpx.WSGITransport(app=wrapped), base_url="http://s") as http:
            yield http, store, holding, hold


def wsgi_post(http: httpx.Client, key: str) -> httpx.Response:
    headers = {"idempotency-key": key, "x-api-key": "shop-1"}
    return http.post("/payments", json={"amount": 42}, headers=headers)


@pytest.mark.parametrize("wsgi_setup", [LONG], indirect=True)
def test_wsgi_a_duplicate_waits_for_the_holder_and_replays_its_answer(
    wsgi_setup: tuple[httpx.Client, WatchedSyncStore, threading.Event, threading.Event],
    provider: FakeProvider,
) -> None:
    http, store, holding, hold = wsgi_setup
    with ThreadPoolExecutor(2) as clients:
        first = clients.submit(wsgi_post, http, "v1")
        assert holding.wait(timeout=30)
        duplicate = clients.submit(wsgi_post, http, "v1")
        assert store.looked.wait(timeout=30)
        hold.set()
        original, again = first.result(), duplicate.result()
    assert original.status_code == 201
    assert again.status_code == 201
    assert again.content == original.content
    assert again.headers["idempotent-replayed"] == "true"
    assert provider.charges_for("v1") == 1


@pytest.mark.parametrize("wsgi_setup", [SHORT], indirect=True)
def test_wsgi_a_duplicate_is_answered_in_flight_once_its_wait_is_over(
    wsgi_setup: tuple[httpx.Client, WatchedSyncStore, threading.Event, threading.Event],
    provider: FakeProvider,
) -> None:
    http, store, holding, hold = wsgi_setup
    with ThreadPoolExecutor(1) as clients:
        first = clients.submit(wsgi_post, http, "v2")
        assert holding.wait(timeout=30)
        duplicate = wsgi_post(http, "v2")
        assert duplicate.status_code == 409
        assert duplicate.headers["retry-after"] == "1"
        assert store.in_flight > 1
        hold.set()
        assert first.result().status_code == 201
    assert provider.charges_for("v2") == 1
