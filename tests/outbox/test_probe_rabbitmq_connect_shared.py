"""The relay's concurrent batches share one RabbitMQ connect.

A broker whose port accepts and never answers the AMQP handshake (a stalled broker, a half-dead
load balancer) held the connect for its whole timeout, under a lock: each batch waiting behind it
then made a connect of its own and waited its own timeout, one after the other (three batches,
three timeouts). They now wait for the one connect and fail with it, at once. ``close()`` (the
relay's stop) cancels a connect in progress instead of leaving it to finish, and a connect that
finishes all the same keeps no connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractExchange

from pgonce.core.outbox import OutboxMessage
from pgonce.errors import BrokerUnavailable
from pgonce.publishers import rabbitmq
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from tests.outbox.conftest import fresh
from tests.outbox.stops import listening

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def message(n: int, aggregatetype: str = "order") -> OutboxMessage:
    return OutboxMessage(
        id=7000 + n,
        aggregatetype=aggregatetype,
        aggregateid=str(n),
        type="order.created",
        payload_json=json.dumps({"n": n}),
        headers={},
        created_at=NOW,
        attempts=0,
    )


@dataclass
class Silent:
    """A loopback server that accepts connections and never answers; it sees them closed."""

    port: int = 0
    accepted: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    connections: int = 0
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        self.accepted.set()
        # What the client sends (the protocol header) is read and left unanswered, until it
        # closes its end.
        while await reader.read(65536):
            pass
        self.closed.set()

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"


@pytest.fixture
async def silent() -> AsyncIterator[Silent]:
    broker = Silent()
    async with listening(broker.accept, broker.writers) as broker.port:
        yield broker


@pytest.fixture
def short_connect(monkeypatch: pytest.MonkeyPatch) -> float:
    """A connect timeout of 2 s: three timeouts in a row are told from one within the test."""
    monkeypatch.setattr(rabbitmq, "CONNECT_TIMEOUT", timedelta(seconds=2))
    return 2.0


async def failures(batches: list[asyncio.Task[object]], within: float) -> list[BaseException]:
    _, pending = await asyncio.wait(batches, timeout=within)
    for task in pending:
        task.cancel()
    assert not pending, f"{len(pending)} of {len(batches)} batches still waited after {within} s"
    errors = [task.exception() for task in batches]
    assert all(isinstance(e, BrokerUnavailable) for e in errors), errors
    return [e for e in errors if e is not None]


async def test_concurrent_batches_fail_together_when_the_connect_times_out(
    silent: Silent, short_connect: float
) -> None:
    publisher = RabbitMQPublisher(silent.url)
    loop = asyncio.get_running_loop()
    started = loop.time()
    batches: list[asyncio.Task[object]] = [
        asyncio.create_task(publisher.publish([message(n)])) for n in range(3)
    ]
    try:
        # One connect for the three, failing within one timeout (it used to take three).
        errors = await failures(batches, within=1.5 * short_connect + 1)
        assert loop.time() - started < 2 * short_connect
        for error in errors:
            assert "did not complete the connection within 2 s" in str(error), error
        assert silent.connections == 1
        # The connection that timed out is closed, not left open.
        await asyncio.wait_for(silent.closed.wait(), short_connect)
        # The next batch makes a connect of its own.
        with pytest.raises(BrokerUnavailable):
            await asyncio.wait_for(publisher.publish([message(9)]), 1.5 * short_connect + 1)
        assert silent.connections == 2
    finally:
        await publisher.close()


async def test_close_cancels_a_connect_in_progress(silent: Silent) -> None:
    """The relay's stop closes the publisher: the batches waiting for a connect to a broker that
    does not answer fail at once, and the half-open connection is closed."""
    publisher = RabbitMQPublisher(silent.url)
    timeout = rabbitmq.CONNECT_TIMEOUT.total_seconds()
    batches: list[asyncio.Task[object]] = [
        asyncio.create_task(publisher.publish([message(n)])) for n in range(3)
    ]
    try:
        await asyncio.wait_for(silent.accepted.wait(), timeout)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(publisher.close(), timeout / 2)
        errors = await failures(batches, within=timeout / 2)
        for error in errors:
            assert "closed while it connected" in str(error), error
        # Closed by the cancel, well before the connect would have timed out on its own.
        await asyncio.wait_for(silent.closed.wait(), timeout / 2)
        assert loop.time() - started < timeout / 2
        assert publisher._connection is None
    finally:
        for task in batches:
            task.cancel()
        await asyncio.wait(batches)
        await publisher.close()


class GatedPublisher(RabbitMQPublisher):
    """Connects to the broker, then waits for ``go`` before it looks at the exchange; with
    ``deaf``, a cancel there is lost and the connect goes on (as a cancel that arrives just as
    the awaited answer does can be lost, e.g. in Python 3.11's wait_for)."""

    def __init__(self, url: str, *, deaf: bool = False) -> None:
        super().__init__(url, declare=True)
        self.deaf = deaf
        self.reached = asyncio.Event()
        self.go = asyncio.Event()
        self.channels: list[AbstractChannel] = []

    async def _find_exchange(self, channel: AbstractChannel) -> AbstractExchange:
        self.channels.append(channel)
        self.reached.set()
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            if not self.deaf:
                raise
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()
            await self.go.wait()
        return await super()._find_exchange(channel)


@pytest.fixture
async def queue(rabbitmq_url: str) -> AsyncIterator[str]:
    name = fresh("pgonce-connect-")
    yield name
    connection = await aio_pika.connect(rabbitmq_url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(name)


@pytest.mark.parametrize("deaf", [False, True], ids=["cancelled", "cancel-lost"])
async def test_a_connect_closed_under_keeps_no_connection(
    rabbitmq_url: str, queue: str, deaf: bool
) -> None:
    publisher = GatedPublisher(rabbitmq_url, deaf=deaf)
    batch = asyncio.create_task(publisher.publish([message(0, queue)]))
    try:
        await asyncio.wait_for(publisher.reached.wait(), 10)
        await asyncio.wait_for(publisher.close(), 1)
        publisher.go.set()
        with pytest.raises(BrokerUnavailable, match="closed while it connected"):
            await asyncio.wait_for(batch, 10)
        # The connection opened for it is closed, and the publisher holds none.
        (opened,) = publisher.channels
        assert opened.is_closed
        assert publisher._connection is None
        assert publisher._channel is None
        # A closed publisher connects again when it is used again.
        assert (await publisher.publish([message(1, queue)])).acked == {7001}
    finally:
        batch.cancel()
        await asyncio.wait({batch})
        await publisher.close()


async def test_a_batch_cancelled_while_waiting_leaves_the_connect_to_the_others(
    rabbitmq_url: str, queue: str
) -> None:
    publisher = GatedPublisher(rabbitmq_url)
    first = asyncio.create_task(publisher.publish([message(0, queue)]))
    try:
        await asyncio.wait_for(publisher.reached.wait(), 10)
        second = asyncio.create_task(publisher.publish([message(1, queue)]))
        first.cancel()
        await asyncio.wait({first})
        assert first.cancelled()
        publisher.go.set()
        result = await asyncio.wait_for(second, 10)
        assert result.acked == {7001}
        assert len(publisher.channels) == 1
    finally:
        first.cancel()
        await asyncio.wait({first})
        await publisher.close()
