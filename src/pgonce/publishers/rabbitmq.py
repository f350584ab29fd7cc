"""RabbitMQ publisher with publisher confirms (aio-pika).

Every message is persistent, carries the outbox id as its AMQP ``message-id`` and is published with
``mandatory``; a batch is pipelined on one confirm-mode channel and each message counts as
acknowledged only when the broker's ``basic.ack`` for it arrived. A ``basic.nack`` or an unroutable
return (no queue bound for the routing key) is a refusal, and so is a message AMQP cannot carry
(headers above a frame, a routing key above 255 bytes), refused before it is sent; a lost
connection leaves the messages unsettled (they are published again, with the same message id).
RabbitMQ keeps the publish order of one channel on each queue, which is what per-aggregate order
needs.

What it publishes to is checked before it is used, and the answer logged: a named exchange must
exist (or is declared, with ``declare``); on the default exchange, where a routing key names a
queue, each routing key is checked for its queue before its first message (or the queue is
declared, with ``declare``). A missing queue is a warning at once, not half an hour of silent
retries before the rows are parked. Bindings of a named exchange cannot be read over AMQP: a
routing key bound to nothing shows as unroutable returns, which the relay logs as they happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from pgonce.core.outbox import OutboxMessage
from pgonce.errors import BrokerUnavailable, ConfigError
from pgonce.extras import needs
from pgonce.publishers.base import (
    PublishResult,
    Routing,
    body,
    by_aggregatetype,
    message_headers,
    short_error,
    url_origin,
)

with needs("rabbitmq", "the RabbitMQ publisher"):
    import aio_pika
    import aiormq
    from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange
    from aiormq.exceptions import ChannelNotFoundEntity
    from pamqp.commands import Basic
    from pamqp.header import ContentHeader

log = logging.getLogger("pgonce.relay")

#: The machine's RabbitMQ in development; in production this comes from configuration.
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
#: How long a batch waits for its confirms. Confirms arrive within milliseconds unless the broker
#: is in trouble (disk or memory alarm); then the rows are retried rather than waiting forever.
DEFAULT_CONFIRM_TIMEOUT = timedelta(seconds=10)


class RabbitMQPublisher:
    """Publishes to ``exchange`` (default: the default exchange, so the routing key names the
    queue) with the routing key ``routing(message)`` (default: the aggregate type).

    With ``declare`` the publisher declares what it publishes to: the exchange (durable, of
    ``exchange_type``), or on the default exchange a durable queue per routing key. Without it,
    it only checks that they exist and says what it found.
    """

    name = "rabbitmq"

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        exchange: str = "",
        routing: Routing | None = None,
        confirm_timeout: timedelta = DEFAULT_CONFIRM_TIMEOUT,
        declare: bool = False,
        exchange_type: str = "topic",
    ) -> None:
        # Said at the start: aio-pika reads the URL only when it connects, and what it raises
        # then would fail every batch (and it may quote the URL, password and all).
        try:
            parts = urlsplit(url)
            # .port raises ValueError for a port that is not a number.
            valid = parts.scheme in ("amqp", "amqps") and (parts.port is None or parts.port > 0)
        except (ValueError, TypeError, AttributeError):
            valid = False
        if not valid:
            raise ConfigError(
                "the RabbitMQ publisher's url must be an amqp:// or amqps:// URL with a valid "
                f"port, not {url_origin(url) if isinstance(url, str) else type(url).__name__}"
            )
        try:
            self.exchange_type = aio_pika.ExchangeType(exchange_type)
        except ValueError:
            kinds = ", ".join(t.value for t in aio_pika.ExchangeType)
            raise ConfigError(
                f"the RabbitMQ exchange_type must be one of {kinds}, not {exchange_type!r}"
            ) from None
        # A wait of nothing would leave every batch unsettled, retried for ever.
        if not confirm_timeout > timedelta(0):
            raise ConfigError("the RabbitMQ publisher's confirm_timeout must be above 0")
        self.url = url
        self.exchange_name = exchange
        self.declare = declare
        #: Routing keys checked on the current connection: whether a queue takes them.
        self._routes: dict[str, bool] = {}
        self.routing = routing or by_aggregatetype("")
        self.confirm_timeout = confirm_timeout
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        self._connecting = asyncio.Lock()

    async def prepare(self) -> None:
        """Connect and check the exchange now, so that a problem is said at the relay's start."""
        await self._connect()

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
            self._routes = {}
            if not self.exchange_name:
                self._exchange = self._channel.default_exchange
            elif self.declare:
                self._exchange = await self._channel.declare_exchange(
                    self.exchange_name, self.exchange_type, durable=True
                )
                log.info("RabbitMQ: declared the exchange %r", self.exchange_name)
            else:
                self._exchange = await self._channel.get_exchange(self.exchange_name)
                log.info(
                    "RabbitMQ: publishing to the exchange %r; a routing key bound to no queue "
                    "shows as unroutable returns",
                    self.exchange_name,
                )
        except ChannelNotFoundEntity as error:
            await self.close()
            raise BrokerUnavailable(
                f"RabbitMQ has no exchange named {self.exchange_name!r}: declare it, or set "
                "[outbox] declare = true to let pgonce declare it"
            ) from error
        except (TimeoutError, OSError, aiormq.exceptions.AMQPError) as error:
            await self.close()
            raise BrokerUnavailable(f"RabbitMQ: {short_error(error)}") from error
        return self._exchange

    async def _check_routes(self, batch: Sequence[OutboxMessage]) -> None:
        """On the default exchange, check (or declare) the queue of each new routing key."""
        if self.exchange_name:
            return
        new: dict[str, str] = {}
        for message in batch:
            key = self.routing(message)
            if key not in self._routes:
                new.setdefault(key, message.aggregatetype)
        for key, aggregatetype in new.items():
            # No queue can have a name above 255 bytes (its messages are refused when sent).
            too_long = len(key) > 63 and len(key.encode()) > 255
            self._routes[key] = not too_long and await self._queue_exists(key, aggregatetype)

    async def _queue_exists(self, key: str, aggregatetype: str) -> bool:
        assert self._connection is not None
        try:
            # A passive declare that fails closes its channel: a short-lived one of its own.
            async with self._connection.channel() as channel:
                queue = await channel.declare_queue(key, durable=True, passive=not self.declare)
        except ChannelNotFoundEntity:
            log.warning(
                "RabbitMQ: no queue named %r, and the default exchange routes a message only to "
                "the queue its routing key names: events of aggregate type %r will be returned "
                "unroutable, retried and then parked; declare the queue (or bind one), or set "
                "[outbox] declare = true",
                key,
                aggregatetype,
            )
            return False
        except aiormq.exceptions.ChannelPreconditionFailed:
            log.info("RabbitMQ: the queue %r exists with other settings; using it", key)
            return True
        except (TimeoutError, OSError, aiormq.exceptions.AMQPError) as error:
            raise BrokerUnavailable(f"RabbitMQ: {short_error(error)}") from error
        declared = queue.declaration_result
        log.info(
            "RabbitMQ: events of aggregate type %r go to the queue %r (%s)",
            aggregatetype,
            key,
            "declared" if self.declare else f"{declared.consumer_count} consumers",
        )
        return True

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        exchange = await self._connect()
        await self._check_routes(batch)
        timeout = self.confirm_timeout.total_seconds()
        refused: dict[int, str] = {}
        kinds: dict[int, str] = {}
        sendable = await self._sendable(batch, refused, kinds)
        # Started in order on one channel: the broker sees them in id order; confirms come back
        # in any grouping, and each future resolves with its own message's answer.
        results = await asyncio.gather(
            *(
                exchange.publish(amqp, self.routing(m), mandatory=True, timeout=timeout)
                for m, amqp in sendable
            ),
            return_exceptions=True,
        )
        acked: set[int] = set()
        lost: str | None = None
        for (message, _), result in zip(sendable, results, strict=True):
            if isinstance(result, Basic.Ack):
                acked.add(message.id)
            elif isinstance(result, aio_pika.exceptions.DeliveryError):
                refused[message.id] = f"RabbitMQ refused the message: {short_error(result)}"
                kinds[message.id] = "nacked"
            elif isinstance(result, TimeoutError):
                lost = f"no confirm from RabbitMQ within {timeout:g} s"
            elif isinstance(result, BaseException):
                # A dropped connection: the broker may or may not have it.
                lost = f"RabbitMQ: {short_error(result)}"
            else:
                refused[message.id] = (
                    f"RabbitMQ returned the message as unroutable (routing key "
                    f"{self.routing(message)!r} on exchange {self.exchange_name!r}: no queue "
                    "is bound for it)"
                )
                kinds[message.id] = "unroutable"
        if lost:
            await self.close()
        return PublishResult(frozenset(acked), refused, kinds, lost)

    async def _sendable(
        self, batch: Sequence[OutboxMessage], refused: dict[int, str], kinds: dict[int, str]
    ) -> list[tuple[OutboxMessage, aio_pika.Message]]:
        """The batch's messages that AMQP can carry; the others are refused into ``refused``.

        A content header larger than a frame makes the broker close the whole connection, and a
        routing key above 255 bytes cannot be encoded: either way every batch holding the row
        would fail as if the connection broke, the row unsettled for ever, never parked. Such a
        row is refused instead, and its aggregate's later rows in the batch wait behind it.
        """
        sendable = []
        held: set[tuple[str, str]] = set()
        limit: int | None = None
        for message in batch:
            if held and (message.aggregatetype, message.aggregateid) in held:
                continue
            amqp = amqp_message(message)
            key = self.routing(message)
            reason = None
            if len(key) > 63 and len(key.encode()) > 255:
                reason = f"its routing key of {len(key.encode())} bytes is above AMQP's 255"
            elif message.headers and (long := _long_header_name(message.headers)):
                # The encoder would cut it to 128 bytes with a warning: the consumer would get
                # another name (two such names, one value).
                reason = f"the header name {long[:40]!r}... is above AMQP's 128 bytes"
            # Headers are few and short in the common case: the exact size (an encoding of
            # the header) only for those that could come near a frame.
            elif message.headers and _headers_bound(message) > _HEADER_MARGIN:
                if limit is None:
                    limit = await self._max_content_size()
                size = len(ContentHeader(0, len(amqp.body), amqp.properties).marshal())
                if size > limit:
                    reason = (
                        f"its headers take {size} bytes, above the {limit} of the connection's "
                        "frame size"
                    )
            if reason is None:
                sendable.append((message, amqp))
                continue
            refused[message.id] = f"RabbitMQ cannot carry the message: {reason}"
            kinds[message.id] = "too_large"
            held.add((message.aggregatetype, message.aggregateid))
        return sendable

    async def _max_content_size(self) -> int:
        assert self._channel is not None
        try:
            channel = await self._channel.get_underlay_channel()
        except (RuntimeError, aiormq.exceptions.AMQPError) as error:
            # The channel closed since the batch connected: the batch waits, as in an outage.
            raise BrokerUnavailable(f"RabbitMQ: {short_error(error)}") from error
        # A frame's payload: the frame size less its 7-byte header and its end octet.
        return int(channel.connection.connection_tune.frame_max) - 8

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


#: Below this bound of a message's encoded headers no check of its header's size is made: the
#: smallest frame size a broker may negotiate is 4,096 bytes (AMQP 0-9-1), RabbitMQ's default
#: 131,072.
_HEADER_MARGIN = 2048


def _headers_bound(message: OutboxMessage) -> int:
    """More bytes than the caller's headers and the outbox facts take in an AMQP table."""
    facts = len(message.type) + len(message.aggregatetype) + len(message.aggregateid) + 64
    return 4 * (facts + sum(len(k) + len(v) + 6 for k, v in message.headers.items()))


def _long_header_name(headers: Mapping[str, str]) -> str | None:
    """A header name above the 128 bytes of an AMQP field name, if there is one."""
    for name in headers:
        if len(name) > 32 and len(name.encode()) > 128:
            return name
    return None


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
