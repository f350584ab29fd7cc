"""Fixtures of the inbox tests: real schemes with a test secret, a real uvicorn server on a free
loopback port, and an ``effects`` table without a unique key, so that a handler that ran twice
shows up as two rows."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import psycopg
import pytest
import uvicorn

from pgonce.core.inbox import InboxEvent
from pgonce.webhooks.schemes import SigningScheme, build_scheme
from pgonce.webhooks.source import Source

SECRET = "inbox-test-secret"
SCHEMA = "pgonce"


def hmac_scheme() -> SigningScheme:
    """Generic HMAC-SHA256, hex, the event id in a header: the simplest real scheme."""
    return build_scheme(
        "generic-hmac", [SECRET], options={"header": "x-signature", "id_header": "x-event-id"}
    )


async def record_effect(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
    """A handler whose effect is one row, written in the event's transaction."""
    await conn.execute(
        "INSERT INTO effects (source, event_id, ordering_key) VALUES (%s, %s, %s)",
        (event.source, event.id, event.ordering_key),
    )


def source(name: str = "shop", **options: Any) -> Source:
    options.setdefault("handler", record_effect)
    return Source(name=name, scheme=hmac_scheme(), **options)


def create_effects(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE effects (n bigserial PRIMARY KEY, source text, event_id text,"
            " ordering_key text, at timestamptz DEFAULT clock_timestamp())"
        )


def effects(dsn: str) -> list[tuple[str, str, str | None]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT source, event_id, ordering_key FROM effects ORDER BY n")
        return list(rows.fetchall())


def statuses(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT event_id, status FROM {SCHEMA}.inbox").fetchall()
    return dict(rows)


@pytest.fixture
def effects_dsn(dsn: str) -> str:
    """The test's database, with the ``effects`` table."""
    create_effects(dsn)
    return dsn


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve(app: Any, lifespan: Literal["on", "off"] = "on") -> Iterator[str]:
    """Run ``app`` in a real uvicorn server (its own thread and event loop, lifespan on unless
    ``lifespan="off"``) on a free loopback port; yield its base URL."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=free_port(),
        log_level="warning",
        lifespan=lifespan,
        loop="asyncio",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the uvicorn server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(20)


async def eventually(check: Callable[[], bool], within: float = 30.0) -> None:
    """Poll ``check`` until it holds; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    for _ in itertools.count():
        if check():
            return
        if time.monotonic() > deadline:
            raise AssertionError("the condition did not hold in time")
        await asyncio.sleep(0.02)
