"""A RabbitMQ URL naming a virtual host the broker lacks (or one the user may not use) is said
as such when the relay starts; it used to show as aiormq's "InvalidFrameError: Expected one of
['Connection.OpenOk'], got <Connection.Close object at 0x...>", which names neither."""

from __future__ import annotations

import pytest

from pgonce.errors import BrokerUnavailable
from pgonce.publishers.rabbitmq import RabbitMQPublisher
from tests.outbox.conftest import fresh


async def test_a_virtual_host_the_broker_lacks_is_named(rabbitmq_url: str) -> None:
    vhost = fresh("pgonce-missing-")
    publisher = RabbitMQPublisher(rabbitmq_url.rstrip("/") + "/" + vhost)
    try:
        with pytest.raises(BrokerUnavailable) as raised:
            await publisher.prepare()
    finally:
        await publisher.close()
    message = str(raised.value)
    assert "virtual host" in message
    assert repr(vhost) in message
    assert "object at 0x" not in message
