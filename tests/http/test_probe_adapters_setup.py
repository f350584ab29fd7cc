"""What the ASGI and the WSGI middlewares (and Flask's extension, on the WSGI one) are given at
set-up: the same misuse is refused by each of them there, naming it, never accepted by one and
found out at a request as a 500, a late TypeError or a claim in another schema."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from fastapi import FastAPI
from flask import Flask
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from pgonce import AsyncKeyStore, KeyStore
from pgonce.contrib import wsgi
from pgonce.contrib.flask import Idempotency
from pgonce.errors import UsageError
from pgonce.http import IdempotencyMiddleware
from pgonce.phases import AsyncPhaseStore, PhaseStore

Build = Callable[..., Any]


def scope_of(scope: Any) -> str:
    return "tenant"


def wsgi_app(environ: Any, start_response: Any) -> list[bytes]:
    start_response("200 OK", [])
    return [b""]


@pytest.fixture
def async_pool(server_dsn: str) -> AsyncConnectionPool[Any]:
    return AsyncConnectionPool(server_dsn, open=False)


@pytest.fixture
def sync_pool(server_dsn: str) -> ConnectionPool[Any]:
    return ConnectionPool(server_dsn, open=False)


@pytest.fixture(params=["asgi", "wsgi", "flask"])
def build(
    request: pytest.FixtureRequest,
    async_pool: AsyncConnectionPool[Any],
    sync_pool: ConnectionPool[Any],
) -> Build:
    """Builds one adapter with its right pool and stores, the options given overriding them."""
    if request.param == "asgi":

        def asgi(**options: Any) -> Any:
            options = {"pool": async_pool, "key_scope": scope_of, **options}
            return IdempotencyMiddleware(FastAPI(), **options)

        asgi.stores = (AsyncKeyStore, AsyncPhaseStore)  # type: ignore[attr-defined]
        return asgi
    if request.param == "wsgi":

        def sync(**options: Any) -> Any:
            options = {"pool": sync_pool, "key_scope": scope_of, **options}
            return wsgi.IdempotencyMiddleware(wsgi_app, **options)

        sync.stores = (KeyStore, PhaseStore)  # type: ignore[attr-defined]
        return sync

    def flask(**options: Any) -> Any:
        options = {"pool": sync_pool, "key_scope": scope_of, **options}
        return Idempotency().init_app(Flask(__name__), **options)

    flask.stores = (KeyStore, PhaseStore)  # type: ignore[attr-defined]
    return flask


@pytest.mark.parametrize(
    ("options", "named"),
    [
        pytest.param({"max_request_bytes": "65536"}, "max_request_bytes", id="request-bytes-str"),
        pytest.param({"max_request_bytes": 0}, "max_request_bytes", id="request-bytes-zero"),
        pytest.param({"max_request_bytes": True}, "max_request_bytes", id="request-bytes-bool"),
        pytest.param({"max_response_bytes": 1.5}, "max_response_bytes", id="response-bytes-float"),
        pytest.param({"max_response_bytes": -1}, "max_response_bytes", id="response-bytes-neg"),
        pytest.param({"retention": 3600}, "retention", id="retention-seconds"),
        pytest.param({"retention": timedelta(seconds=-1)}, "retention", id="retention-negative"),
        pytest.param({"retention": timedelta(days=10**6)}, "retention", id="retention-year-9999"),
        pytest.param({"require_key": "no"}, "require_key", id="require-key-str"),
        pytest.param({"canonicalize_json": None}, "canonicalize_json", id="canonicalize-none"),
        pytest.param({"methods": ["POST", 1]}, "methods", id="method-not-str"),
        pytest.param({"methods": ["PO ST"]}, "methods", id="method-not-token"),
        pytest.param({"routes": ["/payments"]}, "routes", id="routes-not-mapping"),
        pytest.param({"routes": {"payments": ["POST"]}}, "routes", id="route-without-slash"),
        pytest.param({"two_phase": ["charges"]}, "two_phase", id="two-phase-without-slash"),
        pytest.param({"wait": 5}, "wait", id="wait-seconds"),
        pytest.param({"wait": timedelta(0)}, "wait", id="wait-zero"),
    ],
)
def test_a_wrong_option_is_refused_by_every_adapter(
    build: Build, options: dict[str, Any], named: str
) -> None:
    # The stores given too, so that nothing of the option reaches a store's own checks.
    key_store, phase_store = build.stores  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match=named):
        build(store=key_store(), phases=phase_store(), **options)


def test_the_phases_use_the_given_stores_schema(build: Build) -> None:
    key_store, _ = build.stores  # type: ignore[attr-defined]
    middleware = build(store=key_store(schema="billing"))
    assert middleware.phases.schema == "billing"


def test_the_key_stores_schema_is_used_for_its_own_keys(build: Build) -> None:
    _, phase_store = build.stores  # type: ignore[attr-defined]
    middleware = build(phases=phase_store(schema="billing"))
    assert middleware.store.schema == "billing"


def test_stores_on_two_schemas_are_refused(build: Build) -> None:
    key_store, phase_store = build.stores  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match="schema"):
        build(store=key_store(schema="billing"), phases=phase_store(schema="orders"))
    with pytest.raises(UsageError, match="schema"):
        build(store=key_store(schema="billing"), schema="orders")
    # What is right is taken: one schema named three times, every option at its bounds.
    middleware = build(
        store=key_store(schema="billing"),
        phases=phase_store(schema="billing"),
        schema="billing",
        methods=["post", "PATCH"],
        routes={"/payments": ["PUT"], "/": ()},
        two_phase=["/charges/"],
        wait=timedelta(seconds=2),
        retention=timedelta(0),
        max_request_bytes=1,
        max_response_bytes=10**9,
        require_key=False,
        canonicalize_json=False,
    )
    assert middleware.rules.is_two_phase("/charges/1")


def test_an_asgi_app_that_is_not_callable_is_refused(
    async_pool: AsyncConnectionPool[Any],
) -> None:
    with pytest.raises(UsageError, match="ASGI application"):
        IdempotencyMiddleware("app:asgi", pool=async_pool, key_scope=scope_of)  # type: ignore[arg-type]


@pytest.mark.parametrize("flavour", ["wsgi", "flask"])
def test_the_async_pool_is_refused_by_the_wsgi_middleware(
    flavour: str, async_pool: AsyncConnectionPool[Any]
) -> None:
    with pytest.raises(UsageError, match=r"ConnectionPool.*not AsyncConnectionPool"):
        if flavour == "wsgi":
            wsgi.IdempotencyMiddleware(wsgi_app, pool=async_pool, key_scope=scope_of)  # type: ignore[arg-type]
        else:
            Idempotency(Flask(__name__), pool=async_pool, key_scope=scope_of)


def test_an_async_engines_connections_are_refused_by_the_wsgi_middleware(
    server_dsn: str,
) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    from pgonce.contrib.sqlalchemy import EngineConnections

    engine = create_async_engine(server_dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    with pytest.raises(UsageError, match="not EngineConnections"):
        wsgi.IdempotencyMiddleware(
            wsgi_app,
            pool=EngineConnections(engine),  # type: ignore[arg-type]
            key_scope=scope_of,
        )


def test_a_sync_engines_connections_are_refused_by_the_asgi_middleware(
    server_dsn: str,
) -> None:
    from sqlalchemy import create_engine

    from pgonce.contrib.flask import EngineConnections

    engine = create_engine(server_dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    with pytest.raises(UsageError, match="not EngineConnections"):
        IdempotencyMiddleware(
            FastAPI(),
            pool=EngineConnections(engine),  # type: ignore[arg-type]
            key_scope=scope_of,
        )


def test_the_async_phase_store_is_refused_by_the_wsgi_middleware(
    sync_pool: ConnectionPool[Any],
) -> None:
    with pytest.raises(UsageError, match="PhaseStore"):
        wsgi.IdempotencyMiddleware(
            wsgi_app,
            pool=sync_pool,
            key_scope=scope_of,
            phases=AsyncPhaseStore(),  # type: ignore[arg-type]
        )


def test_an_async_key_scope_is_refused_by_the_wsgi_middleware(
    sync_pool: ConnectionPool[Any],
) -> None:
    async def caller(environ: Any) -> str:
        return "tenant"

    with pytest.raises(UsageError, match="async def"):
        wsgi.IdempotencyMiddleware(wsgi_app, pool=sync_pool, key_scope=caller)  # type: ignore[arg-type]
