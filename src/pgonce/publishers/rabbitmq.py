"""RabbitMQ publisher with publisher confirms (aio-pika).

Every message is persistent, carries the outbox id as its AMQP ``message-id`` and is published with
``mandatory``; a batch is pipelined on one confirm-mode channel and each message counts as
acknowledged only when the broker's ``basic.ack`` for it arrived. A ``basic.nack`` or an unroutable
return (no queue bound for the routing key) is a refusal; a lost connection leaves the messages
unsettled (they are published again, with the same message id). RabbitMQ keeps the publish order
of one channel on each queue, which is what per-aggregate order needs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from pgonce.core.outbox import OutboxMessage
from pgonce.errors import BrokerUnavailable
from pgonce.extras import needs
from pgonce.publishers.base import (
    PublishResult,
    Routing,
    body,
    by_aggregatetype,
    message_headers,
    short_error,
)

with needs("rabbitmq", "the RabbitMQ publisher"):
    import aio_pika
    import aiormq
    from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
    from pamqp.commands import Basic

#: The machine's RabbitMQ in development; in production this comes from configuration.
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
#: How long a batch waits for its confirms. Confirms arrive within milliseconds unless the broker
#: is in trouble (disk or memory alarm); then the rows are retried rather than waiting forever.
DEFAULT_CONFIRM_TIMEOUT = timedelta(seconds=10)


class RabbitMQPublisher:
    """Publishes to ``exchange`` (default: the default exchange, so the routing key names the
    queue) with the routing key ``routing(message)`` (default: the aggregate type)."""

    name = "rabbitmq"

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        exchange: str = "",
        routing: Routing | None = None,
        confirm_timeout: timedelta = DEFAULT_CONFIRM_TIMEOUT,
    ) -> None:
        self.url = url
        self.exchange_name = exchange
        self.routing = routing or by_aggregatetype("")
        self.confirm_timeout = confirm_timeout
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._connecting = asyncio.Lock()

    async def _connect(self) -> AbstractExchange:
        # The relay's concurrent batch loops share this publisher: one of them connects.
        async with self._connecting:
            return await self._connect_once()

    async def _connect_once(self) -> AbstractExchange:
        if self._exchange is not None and self._channel is not None and not self._channel.is_closed:
            return self._exchange
        await self.close()
        try:
            self._connection = await aio_pika.connect(self.url, timeout=5)
            self._channel = await self._connection.channel(publisher_confirms=True)
            if self.exchange_name:
                self._exchange = await self._channel.get_exchange(self.exchange_name)
            else:
                self._exchange = self._channel.default_exchange
        except (TimeoutError, OSError, aiormq.exceptions.AMQPError) as error:
            await self.close()
            raise BrokerUnavailable(f"RabbitMQ: {short_error(error)}") from error
        return self._exchange

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        exchange = await self._connect()
        timeout = self.confirm_timeout.total_seconds()
        # Started in order on one channel: the broker sees them in id order; confirms come back
        # in any grouping, and each future resolves with its own message's answer.
        results = await asyncio.gather(
            *(
                exchange.publish(amqp_message(m), self.routing(m), mandatory=True, timeout=timeout)
                for m in batch
            ),
            return_exceptions=True,
        )
        acked: set[int] = set()
        refused: dict[int, str] = {}
        lost = False
        for message, result in zip(batch, results, strict=True):
            if isinstance(result, Basic.Ack):
                acked.add(message.id)
            elif isinstance(result, aio_pika.exceptions.DeliveryError):
                refused[message.id] = f"RabbitMQ refused the message: {short_error(result)}"
            elif isinstance(result, BaseException):
                # A dropped connection or a timeout: the broker may or may not have it.
                lost = True
            else:
                refused[message.id] = (
                    f"RabbitMQ returned the message as unroutable (routing key "
                    f"{self.routing(message)!r} on exchange {self.exchange_name!r})"
                )
        if lost:
            await self.close()
        return PublishResult(frozenset(acked), refused)

    async def close(self) -> None:
        connection, self._connection, self._channel, self._exchange = (
            self._connection,
            None,
            None,
            None,
        )
        if connection is not None and not connection.is_closed:
            # Closing a broken connection may fail; it is gone either way.
            with contextlib.suppress(Exception):
                await connection.close()


def amqp_message(message: OutboxMessage) -> aio_pika.Message:
    """The AMQP message for an outbox row: persistent, JSON, the outbox id as message-id."""
    headers: dict[str, Any] = message_headers(message)
    return aio_pika.Message(
        body(message),
        headers=headers,
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=message.message_id,
        type=message.type,
        timestamp=message.created_at,
    )
