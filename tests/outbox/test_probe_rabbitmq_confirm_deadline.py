"""A RabbitMQ batch waits ``confirm_timeout`` for its confirms, once for the whole batch: the
messages confirmed by then are acknowledged, the others are unsettled with the reason (published
again, with the same message ids), and nothing is reported published that the broker did not
confirm."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import aio_pika
import pytest
from pamqp.header import ContentHeader

from faults.proxy import Proxy
from pgonce.publishers.rabbitmq import RabbitMQPublisher, _Outgoing, amqp_message
from tests.outbox.conftest import fresh
from tests.outbox.test_probe_rabbitmq_connect_shared import message

NO_CONFIRM = "no confirm from RabbitMQ within 1 s"


@pytest.fixture
def proxy(rabbitmq_url: str) -> Iterator[Proxy]:
    with Proxy(tcp=("127.0.0.1", 5672)) as proxy:
        yield proxy


@pytest.fixture
async def queue(rabbitmq_url: str) -> AsyncIterator[str]:
    name = fresh("pgonce-deadline-")
    yield name
    connection = await aio_pika.connect(rabbitmq_url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(name)


async def test_a_batch_without_confirms_is_unsettled_after_the_confirm_timeout(
    proxy: Proxy, queue: str
) -> None:
    publisher = RabbitMQPublisher(
        f"amqp://guest:guest@127.0.0.1:{proxy.port}/",
        declare=True,
        confirm_timeout=timedelta(seconds=1),
    )
    try:
        assert (await publisher.publish([message(0, queue)])).acked == {7000}
        # The broker takes the messages; its confirms never come back.
        proxy.hold(True)
        started = time.monotonic()
        result = await asyncio.wait_for(
            publisher.publish([message(n, queue) for n in range(1, 201)]), 30
        )
        waited = time.monotonic() - started
        assert result.acked == frozenset()
        assert result.refused == {}
        assert result.lost == NO_CONFIRM
        # One deadline for the batch, not one after another.
        assert 0.9 <= waited < 10, waited
        proxy.hold(False)
        # The batch's connection was dropped: the next one publishes them on a new one.
        again = await publisher.publish([message(n, queue) for n in range(1, 201)])
        assert again.acked == {7000 + n for n in range(1, 201)}, again
        assert again.lost is None
    finally:
        proxy.hold(False)
        await publisher.close()


async def test_the_confirmed_messages_of_a_batch_that_timed_out_are_acknowledged(
    rabbitmq_url: str, queue: str
) -> None:
    publisher = RabbitMQPublisher(rabbitmq_url, declare=True, confirm_timeout=timedelta(seconds=1))
    try:
        assert (await publisher.publish([message(0, queue)])).acked == {7000}
        channel = publisher._channel
        assert channel is not None
        underlay: Any = await channel.get_underlay_channel()
        # The broker's confirm of the batch's second message is lost on its way.
        lost_tag = underlay.delivery_tag + 2
        confirm = underlay._confirm_delivery

        def confirm_but_one(delivery_tag: int, frame: object) -> None:
            if delivery_tag != lost_tag:
                confirm(delivery_tag, frame)

        underlay._confirm_delivery = confirm_but_one
        result = await asyncio.wait_for(
            publisher.publish([message(n, queue) for n in range(1, 4)]), 30
        )
        assert result.acked == {7001, 7003}, result
        assert result.refused == {}
        assert result.lost == NO_CONFIRM
        # Unsettled, the message goes again with its id, on a new connection.
        again = await publisher.publish([message(2, queue)])
        assert again.acked == {7002}, again
    finally:
        await publisher.close()


def test_the_publisher_sends_what_amqp_message_describes() -> None:
    """The publisher builds the AMQP properties itself: the same bytes on the wire as the aio-pika
    message of amqp_message, headers of the caller's and all."""
    for headers in ({}, {"traceparent": "00-ab-cd-01", "type": "caller's, overridden"}):
        row = message(3)._replace(headers=headers)
        ours, theirs = _Outgoing(row), amqp_message(row)
        assert ours.body == theirs.body
        assert (
            ContentHeader(0, len(ours.body), ours.properties).marshal()
            == ContentHeader(0, len(theirs.body), theirs.properties).marshal()
        )
