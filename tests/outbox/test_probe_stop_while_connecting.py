"""A relay asked to stop while its loops wait for a connection stops at once.

A database server that accepts connections and does not answer (a stalled host, a pooler whose
pool is full) used to hold SIGTERM for as long as libpq's connect timeout, two minutes and more; no
batch is in progress then, so nothing is lost by giving up the connection.

A broker that does the same held the stop for the publisher's connect timeout (RabbitMQ's 5 s),
and up to the relay's stop grace (10 s) for another publisher: a batch waiting in publish() for its
connection counted as at the broker, though nothing of it was sent. Its rows are claimed, and stay
pending with no attempt counted; the next run publishes them.

So did a batch after the broker's connection closed while the relay was idle (a broker restart, an
idle timeout, a cut): the relay took the publisher for connected, and the batch reconnected inside
publish(). The publisher's ``connected`` says it is not, and the batch connects first.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import psycopg
import pytest
from nats.aio.client import Client as NatsClient

import pgonce.publishers.nats
from faults.proxy import Proxy
from pgonce.publishers.nats import NatsPublisher
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from pgonce.publishers.redis_streams import RedisStreamsPublisher
from pgonce.relay import LOOPS_PER_BATCH_IN_FLIGHT, STOP_WAIT, Relay
from pgonce.store._sync.outbox import enqueue
from tests.outbox.brokers import (
    Received,
    nats_read,
    nats_stream,
    rabbitmq_drain,
    rabbitmq_queue,
    redis_delete,
    redis_read,
)
from tests.outbox.conftest import NATS, RABBITMQ, REDIS, fresh, wait_until
from tests.outbox.stops import drain_with, running, silent_server
from tests.outbox.test_probe_redis_idle_cut import warnings
from tests.outbox.test_probe_stop_while_blocked import cut_lines, pending

#: Below the publishers' 5 s connect timeouts, which the stop used to wait for.
BOUND = STOP_WAIT.total_seconds() + 1


async def test_stop_ends_a_relay_whose_database_does_not_answer() -> None:
    async with silent_server() as silent:
        relay = Relay(
            f"postgresql://postgres@127.0.0.1:{silent.port}/test",
            RedisStreamsPublisher("redis://127.0.0.1:9/0"),
            listen=False,
            concurrency=1,
        )
        async with running(relay) as run:
            await wait_until(lambda: len(silent.held) >= LOOPS_PER_BATCH_IN_FLIGHT)
            await run.stop_within(10, "the relay did not stop while connecting")


def in_transaction(dsn: str) -> int:
    """How many connections to the database hold a transaction open between statements: a batch
    loop that claimed its rows and is at its publisher."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state = 'idle in transaction'"
        ).fetchone()
    return int(row[0]) if row else 0


def outbox_ids(dsn: str) -> list[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [str(i) for (i,) in conn.execute("SELECT id FROM pgonce.outbox ORDER BY id")]


async def test_stop_cancels_batches_waiting_for_a_broker_that_does_not_answer(
    direct_dsn: str, rabbitmq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    queue_name = fresh("pgonce-stop-")
    with psycopg.connect(direct_dsn) as conn:
        for aggregate in ("1", "2"):
            enqueue(conn, queue_name, aggregate, "created", {"n": aggregate})
    # The check at the start fails at once (its connection closed): the loops start without its
    # 5 s.
    async with silent_server(refused=1) as silent:
        # One row per batch, two batches at the broker at once: both rows are claimed, and both
        # batches wait for the one connect.
        relay = Relay(
            direct_dsn,
            RabbitMQPublisher(f"amqp://guest:guest@127.0.0.1:{silent.port}/"),
            listen=False,
            concurrency=2,
            batch_size=1,
        )
        async with running(relay) as run:
            await wait_until(lambda: silent.held and in_transaction(direct_dsn) == 2)
            await run.stop_within(
                BOUND, "the relay did not stop while its batches waited to connect"
            )
    # Nothing was sent, so nothing was marked and no attempt counted; no database statement was
    # cut either.
    assert pending(direct_dsn) == (2, 0)
    assert cut_lines(caplog) == []
    async with rabbitmq_queue(rabbitmq_url, queue_name) as queue:
        await drain_with(direct_dsn, RabbitMQPublisher(rabbitmq_url))
        received = await rabbitmq_drain(queue)
    assert pending(direct_dsn) == (0, None)
    assert sorted(r.message_id for r in received) == outbox_ids(direct_dsn)


#: What a broker received, read when called.
Read = Callable[[], Awaitable[list[Received]]]


@contextlib.asynccontextmanager
async def rabbitmq_received(url: str, name: str) -> AsyncIterator[Read]:
    async with rabbitmq_queue(url, name) as queue:
        yield lambda: rabbitmq_drain(queue)


@contextlib.asynccontextmanager
async def nats_received(url: str, name: str) -> AsyncIterator[Read]:
    async with nats_stream(url, name, [f"outbox.{name}"]) as js:
        yield lambda: nats_read(js, name)


@contextlib.asynccontextmanager
async def redis_received(url: str, name: str) -> AsyncIterator[Read]:
    stream = f"outbox.{name}"
    try:
        yield lambda: redis_read(url, stream)
    finally:
        await redis_delete(url, stream)


#: Whether the publisher's newest connection waits for the broker's first answer, read when called.
Waiting = Callable[[], bool]


def connected_by_then(monkeypatch: pytest.MonkeyPatch) -> Waiting:
    """For a publisher whose connect runs in a task of its own, which a cancelled batch leaves at
    once (RabbitMQ's, and Redis's reconnect): the broker's accept is the moment to stop."""
    return lambda: True


def nats_waiting(monkeypatch: pytest.MonkeyPatch) -> Waiting:
    """nats-py's clients made from here on, the newest one read: "connecting" once its TCP
    connect returned, as it waits for the server's INFO.

    The NATS publisher awaits nats-py's connect in the batch itself, and asyncio.wait_for (which
    nats-py's TCP connect runs in) keeps the result of a connect that completed as the batch was
    cancelled, and drops the cancel (Python 3.11): the stop then waits for the connect timeout.
    That instant, which the broker's accept comes just before, is the race that
    test_probe_stop_at_nats_connect.py holds; stopped while the batch waits for an answer that
    does not come, as here, the stop must be at once.
    """
    clients: list[NatsClient] = []

    class Kept(NatsClient):
        # The publisher's client, kept.
        def __init__(self) -> None:
            super().__init__()
            clients.append(self)

    monkeypatch.setattr(pgonce.publishers.nats, "Client", Kept)
    return lambda: bool(clients) and clients[-1].is_connecting


@dataclass(frozen=True)
class Broker:
    """How a test reaches a broker: its address, its publisher at a URL, what it received for an
    aggregate type, as a queue or stream of that name, and when the publisher's reconnect waits
    for the broker's answer."""

    address: tuple[str, int]
    url: Callable[[int], str]
    publisher: Callable[[str], RabbitMQPublisher | NatsPublisher | RedisStreamsPublisher]
    received: Callable[[str, str], contextlib.AbstractAsyncContextManager[Read]]
    waiting: Callable[[pytest.MonkeyPatch], Waiting]


BROKERS = {
    "rabbitmq": Broker(
        RABBITMQ,
        lambda port: f"amqp://guest:guest@127.0.0.1:{port}/",
        RabbitMQPublisher,
        rabbitmq_received,
        connected_by_then,
    ),
    # nats-py sees the cut and says it is no longer connected; the publisher's next batch
    # connects afresh, which used to count as rows at the broker.
    "nats": Broker(
        NATS,
        lambda port: f"nats://127.0.0.1:{port}",
        NatsPublisher,
        nats_received,
        nats_waiting,
    ),
    # redis-py learns of the cut only in its next command; the publisher reads it from what
    # asyncio already received on the idle connection (its end of file, or a reset).
    "redis": Broker(
        REDIS,
        lambda port: f"redis://127.0.0.1:{port}/0",
        RedisStreamsPublisher,
        redis_received,
        connected_by_then,
    ),
}


@pytest.mark.parametrize("name", sorted(BROKERS))
async def test_stop_cancels_a_batch_reconnecting_after_an_idle_connection_was_cut(
    name: str,
    direct_dsn: str,
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    broker = BROKERS[name]
    url = request.getfixturevalue(f"{name}_url")
    aggregatetype = fresh("stop")
    waiting = broker.waiting(monkeypatch)
    async with broker.received(url, aggregatetype) as received:
        with Proxy(tcp=broker.address) as proxy:
            publisher = broker.publisher(broker.url(proxy.port))
            relay = Relay(direct_dsn, publisher, listen=True, concurrency=1)
            with psycopg.connect(direct_dsn) as conn:
                enqueue(conn, aggregatetype, "1", "created", {"n": 1})
            async with running(relay) as run:
                await wait_until(lambda: pending(direct_dsn) == (0, None))
                assert publisher.connected
                # The broker's connection goes while the relay is idle, and the broker then
                # accepts connections and does not answer.
                proxy.hold(True)
                accepted = proxy.accepted
                assert proxy.cut() == 1
                await wait_until(lambda: not publisher.connected)
                with psycopg.connect(direct_dsn) as conn:
                    enqueue(conn, aggregatetype, "2", "created", {"n": 2})
                await wait_until(
                    lambda: (
                        proxy.accepted > accepted and waiting() and in_transaction(direct_dsn) == 1
                    )
                )
                await run.stop_within(BOUND, "the relay did not stop while its batch reconnected")
        # The second row's batch sent nothing: it is pending, with no attempt counted, and no
        # outage was said for it.
        assert pending(direct_dsn) == (1, 0)
        assert cut_lines(caplog) == []
        assert warnings(caplog) == []
        await drain_with(direct_dsn, broker.publisher(url))
        messages = await received()
    assert pending(direct_dsn) == (0, None)
    assert [r.aggregateid for r in messages] == ["1", "2"]
    assert sorted(r.message_id for r in messages) == outbox_ids(direct_dsn)
