"""Fixtures for the outbox tests: the real brokers on loopback, fresh names, a real HTTP receiver.

A test that needs a broker asks for its fixture; when nothing answers on the broker's port the test
is skipped with the reason, except under ``PGONCE_REQUIRE_SERVICES=1`` (CI), where it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pgonce.core.outbox import OutboxMessage

RABBITMQ = ("127.0.0.1", 5672)
NATS = ("127.0.0.1", 4222)
REDIS = ("127.0.0.1", 6379)


def answers(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with closing(socket.create_connection((host, port), timeout=timeout)):
            return True
    except OSError:
        return False


def require_service(name: str, host: str, port: int) -> None:
    """Skip the test (fail it under PGONCE_REQUIRE_SERVICES=1) unless ``name`` answers."""
    if answers(host, port):
        return
    reason = f"{name} is not answering on {host}:{port}; start it to run this test"
    if os.environ.get("PGONCE_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (PGONCE_REQUIRE_SERVICES=1 requires it)")
    pytest.skip(reason)


def fresh(prefix: str) -> str:
    """A stream, queue or subject name no other test uses."""
    return f"{prefix}{uuid.uuid4().hex[:12]}"


@pytest.fixture
def rabbitmq_url() -> str:
    require_service("RabbitMQ", *RABBITMQ)
    return f"amqp://guest:guest@{RABBITMQ[0]}:{RABBITMQ[1]}/"


@pytest.fixture
def nats_url() -> str:
    require_service("NATS", *NATS)
    return f"nats://{NATS[0]}:{NATS[1]}"


@pytest.fixture
def redis_url() -> str:
    require_service("Redis", *REDIS)
    return f"redis://{REDIS[0]}:{REDIS[1]}/0"


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Receiver:
    """A webhook receiver on a real loopback port: records every request, answers ``status``."""

    url: str
    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    #: What to answer; a function of the request count lets a test fail the first N deliveries.
    status: Callable[[int], int] = lambda _n: 204
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def wait_for(self, count: int, timeout: float = 10.0) -> None:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.requests) >= count, timeout), (
                f"{len(self.requests)} of {count} webhooks arrived"
            )


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    port = free_port()
    box = Receiver(url=f"http://127.0.0.1:{port}/hooks")

    async def hooks(request: Request) -> Response:
        body = await request.body()
        with box.arrived:
            box.requests.append((dict(request.headers), body))
            count = len(box.requests)
            box.arrived.notify_all()
        return Response(status_code=box.status(count))

    app = Starlette(routes=[Route("/hooks", hooks, methods=["POST"])])
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = 100
    while not server.started and deadline:
        threading.Event().wait(0.05)
        deadline -= 1
    assert server.started, "the webhook receiver did not start"
    try:
        yield box
    finally:
        server.should_exit = True
        thread.join(timeout=5)


async def wait_until(predicate: Callable[[], Any], within: float = 10.0) -> None:
    """Poll a condition (sync or async) until true, failing after ``within`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {within} s")
        await asyncio.sleep(0.02)


#: When the rows of outbox_rows() were created.
ROWS_CREATED = datetime(2026, 1, 1, tzinfo=UTC)


def outbox_rows(count: int, *, first: int = 1, one_aggregate: bool = False) -> list[OutboxMessage]:
    """``count`` outbox rows as a relay hands them to a publisher: ids from ``first``, payload
    ``{"n": id}``; each of its own order aggregate, or all of order 1 (each then waits for the
    one before it)."""
    return [
        OutboxMessage(
            id=first + n,
            aggregatetype="order",
            aggregateid="1" if one_aggregate else str(n),
            type="order.created",
            payload_json=json.dumps({"n": first + n}),
            headers={},
            created_at=ROWS_CREATED,
            attempts=0,
        )
        for n in range(count)
    ]
