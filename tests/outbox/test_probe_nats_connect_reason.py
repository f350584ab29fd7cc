"""A NATS server the publisher cannot connect to is reported with the reason (connection refused,
a name that does not resolve, ...), as the other publishers report theirs; it used to be nats-py's
"NoServersError: nats: no servers available for connection" alone, which says neither why nor
where."""

from __future__ import annotations

import pytest

from pgonce.errors import BrokerUnavailable
from pgonce.publishers.nats import NatsPublisher
from tests.outbox.conftest import free_port


async def test_a_refused_connection_is_reported_with_its_reason() -> None:
    port = free_port()
    publisher = NatsPublisher(f"nats://127.0.0.1:{port}")
    try:
        with pytest.raises(BrokerUnavailable) as raised:
            await publisher.prepare()
    finally:
        await publisher.close()
    message = str(raised.value)
    assert "ConnectionRefusedError" in message
    assert str(port) in message
