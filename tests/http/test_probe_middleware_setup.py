"""What the ASGI middleware is given at set-up: a wrong pool or store is refused there, naming it,
not found out at the first request as an AttributeError or a TypeError from ``await``."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from psycopg_pool import ConnectionPool

from pgonce import AsyncKeyStore, KeyStore
from pgonce.errors import UsageError
from pgonce.http import IdempotencyMiddleware
from pgonce.phases import AsyncPhaseStore, PhaseStore


def scope_of(scope: Any) -> str:
    return "tenant"


def test_a_dsn_given_as_the_pool_is_refused() -> None:
    with pytest.raises(UsageError, match="pool must be"):
        IdempotencyMiddleware(FastAPI(), pool="postgresql://db/app", key_scope=scope_of)  # type: ignore[arg-type]


def test_a_sync_pool_is_refused() -> None:
    pool = ConnectionPool("postgresql://db/app", open=False)
    with pytest.raises(UsageError, match=r"AsyncConnectionPool.*not ConnectionPool"):
        IdempotencyMiddleware(FastAPI(), pool=pool, key_scope=scope_of)  # type: ignore[arg-type]


def test_the_sync_stores_are_refused() -> None:
    with pytest.raises(UsageError, match="AsyncKeyStore"):
        IdempotencyMiddleware(
            FastAPI(),
            pool=AsyncPool(),
            key_scope=scope_of,
            store=KeyStore(),  # type: ignore[arg-type]
        )
    with pytest.raises(UsageError, match="AsyncPhaseStore"):
        IdempotencyMiddleware(
            FastAPI(),
            pool=AsyncPool(),
            key_scope=scope_of,
            phases=PhaseStore(),  # type: ignore[arg-type]
        )
    # The async ones are what it takes.
    IdempotencyMiddleware(
        FastAPI(),
        pool=AsyncPool(),
        key_scope=scope_of,
        store=AsyncKeyStore(),
        phases=AsyncPhaseStore(),
    )


class AsyncPool:
    """Anything with connection(), as a SQLAlchemy engine's EngineConnections."""

    def connection(self) -> Any:
        raise AssertionError("not used at set-up")
