"""A RabbitMQ connection cut under the relay's concurrent batches is a broker outage for each of
them: a batch on its way when another batch saw the cut (and dropped the connection) waits as in
an outage (BrokerUnavailable), where it used to fail with a bare AssertionError that the relay
logged as a publisher bug. aiormq's own warning with a traceback for each cut connection is not
logged beside the relay's line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta

import aio_pika
import pytest

from faults.proxy import Proxy
from pgonce.errors import BrokerUnavailable
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from tests.outbox.conftest import fresh, wait_until
from tests.outbox.test_probe_rabbitmq_connect_shared import message


class PausingPublisher(RabbitMQPublisher):
    """Stops a batch after its first routing key was checked, until ``go`` is set."""

    def __init__(self, url: str) -> None:
        super().__init__(url, declare=True)
        self.pause = False
        self.paused = asyncio.Event()
        self.go = asyncio.Event()

    async def _queue_exists(self, *args: object) -> bool:
        exists = await super()._queue_exists(*args)  # type: ignore[arg-type]
        if self.pause:
            self.pause = False
            self.paused.set()
            await self.go.wait()
        return exists


@pytest.fixture
def proxy(rabbitmq_url: str) -> Iterator[Proxy]:
    with Proxy(tcp=("127.0.0.1", 5672)) as proxy:
        yield proxy


@pytest.fixture
async def queues(rabbitmq_url: str) -> AsyncIterator[list[str]]:
    names = [fresh("pgonce-cut-") for _ in range(3)]
    yield names
    connection = await aio_pika.connect(rabbitmq_url)
    async with connection:
        channel = await connection.channel()
        for name in names:
            await channel.queue_delete(name)


async def awaits_a_confirm(publisher: RabbitMQPublisher) -> bool:
    channel = publisher._channel
    if channel is None or channel.is_closed:
        return False
    underlay = await channel.get_underlay_channel()
    return bool(underlay.confirmations)  # type: ignore[attr-defined]


async def test_a_batch_on_its_way_when_another_saw_the_cut_waits_as_in_an_outage(
    proxy: Proxy, queues: list[str]
) -> None:
    seen, new_one, new_two = queues
    publisher = PausingPublisher(f"amqp://guest:guest@127.0.0.1:{proxy.port}/")
    try:
        first = await publisher.publish([message(0, seen)])
        assert first.acked == {7000}
        # One batch has checked the first of its two new routing keys, and goes on later.
        publisher.pause = True
        checking = asyncio.create_task(
            publisher.publish([message(1, new_one), message(2, new_two)])
        )
        await publisher.paused.wait()
        # Another waits for its confirm when the connection is cut under both.
        proxy.hold(True)
        publishing = asyncio.create_task(publisher.publish([message(3, seen)]))
        await wait_until(lambda: awaits_a_confirm(publisher))
        assert proxy.cut() >= 1
        cut = await asyncio.wait_for(publishing, 30)
        assert cut.acked == frozenset()
        assert cut.lost
        assert "0x" not in cut.lost, cut.lost
        proxy.hold(False)
        publisher.go.set()
        # The checking batch's connection is gone: an outage, not an AssertionError.
        with pytest.raises(BrokerUnavailable):
            await asyncio.wait_for(checking, 30)
        # Both are published on the next connection, with their message ids.
        again = await publisher.publish(
            [message(1, new_one), message(2, new_two), message(3, seen)]
        )
        assert again.acked == {7001, 7002, 7003}, again
    finally:
        proxy.hold(False)
        await publisher.close()


async def test_a_cut_connection_is_not_logged_by_aiormq_with_a_traceback(
    proxy: Proxy, queues: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    publisher = RabbitMQPublisher(f"amqp://guest:guest@127.0.0.1:{proxy.port}/", declare=True)
    try:
        assert (await publisher.publish([message(0, queues[0])])).acked == {7000}
        channel = publisher._channel
        assert channel is not None
        assert proxy.cut() >= 1
        # aiormq closes the channels after it logged why its reader ended.
        await wait_until(lambda: channel.is_closed)
        result = None
        with contextlib.suppress(BrokerUnavailable):
            result = await publisher.publish([message(1, queues[0])])
        if result is None or not result.acked:
            result = await publisher.publish([message(1, queues[0])])
        assert result.acked == {7001}
    finally:
        await publisher.close()
    noisy = [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.name.startswith("aiormq") and (r.levelno >= logging.WARNING or r.exc_info)
    ]
    assert noisy == []


async def test_a_blocked_connection_is_an_outage_not_a_wait_for_ever(
    rabbitmq_url: str, queues: list[str]
) -> None:
    """A broker under a memory or disk alarm sends connection.blocked and opens no channel on
    that connection until the alarm clears: the check of a new routing key waited for ever (and
    for ever once the connection was closed), the batch loop stalled without a line."""
    from pamqp.commands import Connection as Frames

    publisher = RabbitMQPublisher(rabbitmq_url, declare=True, confirm_timeout=timedelta(seconds=1))
    try:
        assert (await publisher.publish([message(0, queues[0])])).acked == {7000}
        connection = publisher._connection
        assert connection is not None
        underlay = connection.transport
        assert underlay is not None
        # What aiormq does on the broker's connection.blocked (an alarm cannot be raised on a
        # shared broker).
        await underlay.connection._Connection__handle_connection_blocked(  # type: ignore[attr-defined]
            Frames.Blocked(reason="low on memory")
        )
        with pytest.raises(BrokerUnavailable, match="did not answer within 1 s"):
            await asyncio.wait_for(publisher.publish([message(1, queues[1])]), 30)
    finally:
        await publisher.close()
    # A new connection, not blocked, publishes.
    assert (await publisher.publish([message(1, queues[1])])).acked == {7001}
    await publisher.close()
