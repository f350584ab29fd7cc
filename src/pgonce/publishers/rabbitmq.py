"""RabbitMQ publisher with publisher confirms (aio-pika).

Every message is persistent, carries the outbox id as its AMQP ``message-id`` and is published with
``mandatory``; a batch is pipelined on one confirm-mode channel and each message counts as
acknowledged only when the broker's ``basic.ack`` for it arrived. A ``basic.nack`` or an unroutable
return (no queue bound for the routing key) is a refusal, and so is a message AMQP cannot carry
(headers above a frame, a routing key above 255 bytes, a body above ``max_message_size``) or one
the routing function raised for, refused before it is sent; a lost connection leaves the messages
unsettled (they are published again, with the same message id). A body above the broker's own
``max_message_size`` that got through (the publisher's setting above the broker's) makes the broker
close the channel with ``406 PRECONDITION_FAILED``: that row is refused, the rows sent after it on
the channel are unsettled, and the publisher keeps the broker's limit for the rows to come.
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
import re
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from pgonce.core.outbox import OutboxMessage
from pgonce.errors import BrokerUnavailable, ConfigError
from pgonce.extras import needs
from pgonce.publishers.base import (
    PublishResult,
    Routing,
    SharedConnect,
    body,
    by_aggregatetype,
    check_timeout,
    message_headers,
    route_or_refuse,
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


def _not_a_failed_connect(record: logging.LogRecord) -> bool:
    """aiormq logs, as an error of its own, every connection it cannot make, then raises it. The
    publisher raises it on as BrokerUnavailable, which the relay reports once a minute with what
    happens next; aiormq's line repeated that at every retry of every batch loop."""
    return record.msg not in _AIORMQ_REPEATS


#: aiormq's lines for a connection it could not make and for one that broke under it (the latter
#: with a traceback): the relay says each in one line of its own, with what happens next.
_AIORMQ_REPEATS = frozenset(
    ("error when creating transport: %r", "Cancelling cause reader exited abnormally")
)


logging.getLogger("aiormq.connection").addFilter(_not_a_failed_connect)

#: The machine's RabbitMQ in development; in production this comes from configuration.
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/"
#: How long opening the connection may take: the TCP connect, the AMQP handshake, the login and
#: the virtual host. A port that accepts and never answers (a stalled broker, a half-dead load
#: balancer) is an outage after this, for every batch waiting for that connection at once.
CONNECT_TIMEOUT = timedelta(seconds=5)
#: How long a batch waits for its confirms. Confirms arrive within milliseconds unless the broker
#: is in trouble (disk or memory alarm); then the rows are retried rather than waiting forever.
DEFAULT_CONFIRM_TIMEOUT = timedelta(seconds=10)
#: RabbitMQ's default ``max_message_size`` from 3.8 to 3.13 (RabbitMQ 4 lowered it to 16 MiB; its
#: most is 512 MiB). A body above it is refused before it is sent; a broker set lower says so by
#: closing the channel, and the publisher then keeps the broker's figure.
DEFAULT_MAX_MESSAGE_SIZE = 128 * 1024 * 1024
#: How RabbitMQ words the channel close for a body above its max_message_size (3.8 and later).
_TOO_LARGE = re.compile(r"message size (\d+) is larger than (?:configured )?max size (\d+)")


class RabbitMQPublisher:
    """Publishes to ``exchange`` (default: the default exchange, so the routing key names the
    queue) with the routing key ``routing(message)`` (default: the aggregate type).

    With ``declare`` the publisher declares what it publishes to: the exchange (durable, of
    ``exchange_type``), or on the default exchange a durable queue per routing key. Without it,
    it only checks that they exist and says what it found.

    ``max_message_size`` is the largest body the broker takes (its own setting of that name): a
    row with a larger body is refused before it is sent.
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
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
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
        check_timeout("the RabbitMQ publisher's confirm_timeout", confirm_timeout)
        if type(max_message_size) is not int or max_message_size < 1:
            raise ConfigError(
                "the RabbitMQ publisher's max_message_size must be a whole number of bytes of at "
                f"least 1, not {max_message_size!r}"
            )
        self.url = url
        self.exchange_name = exchange
        self.declare = declare
        #: Routing keys checked on the current connection: whether a queue takes them.
        self._routes: dict[str, bool] = {}
        self.routing = routing or by_aggregatetype("")
        self.confirm_timeout = confirm_timeout
        #: Lowered to the broker's own figure when the broker refuses a body above it.
        self.max_message_size = max_message_size
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None
        #: The connect in progress, which every batch without a connection waits for.
        self._opening = SharedConnect[_Link]("RabbitMQ")
        #: Counts the closes: a connect that finishes after one keeps no connection.
        self._closes = 0

    async def prepare(self) -> None:
        """Connect and check the exchange now, so that a problem is said at the relay's start."""
        await self._connect()

    @property
    def connected(self) -> bool:
        """Whether a batch would go out on an open connection and channel, without connecting
        first: aio-pika closes them when the broker closes the connection or the network cuts
        it, idle or not."""
        connection, channel = self._connection, self._channel
        return (
            connection is not None
            and channel is not None
            and self._exchange is not None
            and not connection.is_closed
            and not channel.is_closed
        )

    async def _connect(self) -> _Link:
        connection, channel, exchange = self._connection, self._channel, self._exchange
        if (
            connection is not None
            and channel is not None
            and exchange is not None
            and not connection.is_closed
            and not channel.is_closed
        ):
            return connection, channel, exchange
        return await self._wait_for_connect()

    async def _wait_for_connect(self) -> _Link:
        """The link of the connect in progress, or of a new one (:class:`SharedConnect`).

        Each batch keeps the connection it got:
        a broker cut seen by another batch must neither leave it without one nor make it close
        the connection made since.
        """
        return await self._opening.wait(self._open)

    async def _open(self) -> _Link:
        """Connect, open the confirm-mode channel and find the exchange, within
        :data:`CONNECT_TIMEOUT` for the connection and ``confirm_timeout`` for the rest."""
        closes = self._closes
        await self._forget()
        connection: AbstractConnection | None = None
        channel: AbstractChannel | None = None
        try:
            connect_timeout = CONNECT_TIMEOUT.total_seconds()
            # aio-pika's own timeout covers the handshake; this one the whole connect.
            async with asyncio.timeout(connect_timeout):
                connection = await aio_pika.connect(self.url, timeout=connect_timeout)
            # A channel opens only once the broker unblocks a blocked connection (a memory or
            # disk alarm): waited for as long as a confirm, then an outage.
            async with asyncio.timeout(self.confirm_timeout.total_seconds()):
                channel = await connection.channel(publisher_confirms=True)
                exchange = await self._find_exchange(channel)
        except BaseException as error:
            if connection is not None:
                await _close_quietly(connection)
            unavailable = self._unavailable(error, connection is not None)
            if unavailable is None:
                raise
            raise unavailable from error
        if closes != self._closes:
            # close() came while this connect was on its way (and its cancel did not reach it):
            # the publisher is closed, and keeps no connection.
            await _close_quietly(connection)
            raise BrokerUnavailable("RabbitMQ: the publisher was closed while it connected")
        self._routes = {}
        self._connection, self._channel, self._exchange = connection, channel, exchange
        return connection, channel, exchange

    async def _find_exchange(self, channel: AbstractChannel) -> AbstractExchange:
        if not self.exchange_name:
            return channel.default_exchange
        if self.declare:
            exchange = await channel.declare_exchange(
                self.exchange_name, self.exchange_type, durable=True
            )
            log.info("RabbitMQ: declared the exchange %r", self.exchange_name)
            return exchange
        exchange = await channel.get_exchange(self.exchange_name)
        log.info(
            "RabbitMQ: publishing to the exchange %r; a routing key bound to no queue "
            "shows as unroutable returns",
            self.exchange_name,
        )
        return exchange

    def _unavailable(self, error: BaseException, connected: bool) -> BrokerUnavailable | None:
        """What a failed connect says, as an outage; None for what is no outage (a cancel)."""
        if isinstance(error, ChannelNotFoundEntity):
            return BrokerUnavailable(
                f"RabbitMQ has no exchange named {self.exchange_name!r}: declare it, or set "
                "[outbox] declare = true to let pgonce declare it"
            )
        if isinstance(error, aiormq.exceptions.InvalidFrameError):
            if "Connection.OpenOk" not in str(error) or "Connection.Close" not in str(error):
                return BrokerUnavailable(f"RabbitMQ: {short_error(error)}")
            # The broker's answer to opening the virtual host was to close the connection;
            # aiormq keeps only the frame's repr, not the broker's reason.
            vhost = unquote(urlsplit(self.url).path[1:]) or "/"
            return BrokerUnavailable(
                f"RabbitMQ refused to open the virtual host {vhost!r}: it does not exist, or the "
                "user may not use it; check the URL's path and the user's permissions"
            )
        if isinstance(error, TimeoutError):
            if connected:
                # Connected: the channel's open (or the exchange's check) was what timed out.
                return BrokerUnavailable(_no_answer(self.confirm_timeout))
            return BrokerUnavailable(
                f"RabbitMQ did not complete the connection within "
                f"{CONNECT_TIMEOUT.total_seconds():g} s (the port accepts, the broker does not "
                "answer)"
            )
        if isinstance(error, (OSError, aiormq.exceptions.AMQPError)):
            return BrokerUnavailable(f"RabbitMQ: {short_error(error)}")
        return None

    async def _check_routes(
        self, connection: AbstractConnection, sendable: Sequence[_Sendable]
    ) -> None:
        """On the default exchange, check (or declare) the queue of each new routing key."""
        if self.exchange_name:
            return
        new: dict[str, str] = {}
        for message, _, key in sendable:
            if key not in self._routes:
                new.setdefault(key, message.aggregatetype)
        for key, aggregatetype in new.items():
            # No queue can have a name above 255 bytes (its messages are refused when sent).
            too_long = len(key) > 63 and len(key.encode()) > 255
            exists = not too_long and await self._queue_exists(connection, key, aggregatetype)
            if connection is self._connection:
                self._routes[key] = exists

    async def _queue_exists(
        self, connection: AbstractConnection, key: str, aggregatetype: str
    ) -> bool:
        if connection.is_closed:
            # Lost while this batch was on its way (another batch saw the cut and closed it).
            raise BrokerUnavailable("RabbitMQ: the connection was lost")
        try:
            # A passive declare that fails closes its channel: a short-lived one of its own.
            # Bounded as a confirm is: a connection the broker blocked (memory or disk alarm)
            # opens no channel until the alarm clears, and it never does once the connection
            # is closed.
            async with (
                asyncio.timeout(self.confirm_timeout.total_seconds()),
                connection.channel() as channel,
            ):
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
        except TimeoutError as error:
            raise BrokerUnavailable(_no_answer(self.confirm_timeout)) from error
        except (OSError, RuntimeError, aiormq.exceptions.AMQPError) as error:
            # RuntimeError: aio-pika's word for a channel opened on a connection that closed.
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
        connection, channel, exchange = await self._connect()
        timeout = self.confirm_timeout.total_seconds()
        refused: dict[int, str] = {}
        kinds: dict[int, str] = {}
        sendable = await self._sendable(channel, batch, refused, kinds)
        await self._check_routes(connection, sendable)
        # Started in order on one channel: the broker sees them in id order; confirms come back
        # in any grouping, and each task ends with its own message's answer. One deadline for
        # the batch: a timeout of each message's own armed and cancelled a timer per message,
        # some 7 % of the publisher's CPU time per message.
        sends = [
            asyncio.ensure_future(exchange.publish(cast(Any, amqp), key, mandatory=True))
            for _, amqp, key in sendable
        ]
        results: list[object]
        try:
            async with asyncio.timeout(timeout):
                results = await asyncio.gather(*sends, return_exceptions=True)
        except TimeoutError:
            # The deadline cancelled the messages still unanswered (gather waits until each
            # has ended); those answered keep their answer.
            results = [_answer(send) for send in sends]
        acked: set[int] = set()
        lost: str | None = None
        for (message, amqp, key), result in zip(sendable, results, strict=True):
            if isinstance(result, Basic.Ack):
                acked.add(message.id)
            elif isinstance(result, aio_pika.exceptions.DeliveryError):
                refused[message.id] = f"RabbitMQ refused the message: {short_error(result)}"
                kinds[message.id] = "nacked"
            elif isinstance(result, TimeoutError):
                lost = f"no confirm from RabbitMQ within {timeout:g} s"
            elif isinstance(result, aiormq.exceptions.ChannelPreconditionFailed) and (
                too_large := self._above_broker_limit(result, len(amqp.body))
            ):
                # The broker closed the channel for this body: this row can never be taken
                # (until the broker's setting changes). Left unsettled, it would close the
                # channel again at every batch, never parked. The rows sent after it on the
                # channel (any batch's) got the same close and wait, unsettled, for a new one.
                refused[message.id] = too_large
                kinds[message.id] = "too_large"
                lost = f"RabbitMQ closed the channel: {short_error(result)}"
            elif isinstance(result, aiormq.exceptions.ChannelInvalidStateError):
                # Sent on, or waiting on, a channel already closed: the cause (a cut, a close
                # by the broker) is another message's answer; aiormq says only the channel's repr.
                lost = lost or "RabbitMQ: the channel closed under the batch (connection lost)"
            elif isinstance(result, BaseException):
                # A dropped connection: the broker may or may not have it. The first answer
                # says why; the messages after it only share the close.
                lost = lost or f"RabbitMQ: {short_error(result)}"
            else:
                refused[message.id] = (
                    f"RabbitMQ returned the message as unroutable (routing key "
                    f"{key!r} on exchange {self.exchange_name!r}: no queue "
                    "is bound for it)"
                )
                kinds[message.id] = "unroutable"
        if lost:
            await self._drop(connection)
        return PublishResult(frozenset(acked), refused, kinds, lost)

    def _above_broker_limit(self, error: BaseException, size: int) -> str | None:
        """The refusal of a body of ``size`` bytes if ``error`` is the broker's channel close for
        a body above its max_message_size and this body is above it; the publisher keeps the
        broker's figure for the rows to come."""
        found = _TOO_LARGE.search(str(error))
        if found is None:
            return None
        limit = int(found.group(2))
        if size <= limit:
            # Another message's close: this one waits for the next channel.
            return None
        if limit < self.max_message_size:
            log.warning(
                "RabbitMQ: the broker's max_message_size is %d bytes, below the publisher's %d; "
                "a larger body is refused before it is sent from now on",
                limit,
                self.max_message_size,
            )
            self.max_message_size = limit
        return f"RabbitMQ cannot carry the message: {_too_large(size, limit)}"

    async def _sendable(
        self,
        channel: AbstractChannel,
        batch: Sequence[OutboxMessage],
        refused: dict[int, str],
        kinds: dict[int, str],
    ) -> list[_Sendable]:
        """The batch's messages that AMQP can carry, with their routing keys; the others are
        refused into ``refused``.

        A content header larger than a frame makes the broker close the whole connection, a body
        above the broker's max_message_size closes the channel, and a routing key above 255
        bytes cannot be encoded: either way every batch holding the row would fail as if the
        connection broke, the row unsettled for ever, never parked. A routing function that
        raises for a row would fail every batch holding it. Such a row is refused instead, and
        its aggregate's later rows in the batch wait behind it.
        """
        sendable = []
        held: set[tuple[str, str]] = set()
        limit: int | None = None
        for message in batch:
            if held and (message.aggregatetype, message.aggregateid) in held:
                continue
            key = route_or_refuse(self.routing, message, refused, kinds)
            if key is None:
                held.add((message.aggregatetype, message.aggregateid))
                continue
            amqp = _Outgoing(message)
            reason = None
            if len(amqp.body) > self.max_message_size:
                reason = _too_large(len(amqp.body), self.max_message_size)
            elif len(key) > 63 and len(key.encode()) > 255:
                reason = f"its routing key of {len(key.encode())} bytes is above AMQP's 255"
            elif message.headers and (long := _long_header_name(message.headers)):
                # The encoder would cut it to 128 bytes with a warning: the consumer would get
                # another name (two such names, one value).
                reason = f"the header name {long[:40]!r}... is above AMQP's 128 bytes"
            # Headers are few and short in the common case: the exact size (an encoding of
            # the header) only for those that could come near a frame.
            elif message.headers and _headers_bound(message) > _HEADER_MARGIN:
                if limit is None:
                    limit = await self._max_content_size(channel)
                size = len(ContentHeader(0, len(amqp.body), amqp.properties).marshal())
                if size > limit:
                    reason = (
                        f"its headers take {size} bytes, above the {limit} of the connection's "
                        "frame size"
                    )
            if reason is None:
                sendable.append((message, amqp, key))
                continue
            refused[message.id] = f"RabbitMQ cannot carry the message: {reason}"
            kinds[message.id] = "too_large"
            held.add((message.aggregatetype, message.aggregateid))
        return sendable

    async def _max_content_size(self, channel: AbstractChannel) -> int:
        try:
            underlay = await channel.get_underlay_channel()
        except (RuntimeError, aiormq.exceptions.AMQPError) as error:
            # The channel closed since the batch connected: the batch waits, as in an outage.
            raise BrokerUnavailable(f"RabbitMQ: {short_error(error)}") from error
        # A frame's payload: the frame size less its 7-byte header and its end octet.
        return int(underlay.connection.connection_tune.frame_max) - 8

    async def _drop(self, connection: AbstractConnection) -> None:
        """Close a batch's connection that broke; the publisher's own only if it is still that
        one (another batch may have connected since)."""
        if connection is self._connection:
            await self._forget()
        elif not connection.is_closed:
            await _close_quietly(connection)

    async def close(self) -> None:
        """Close the connection; a connect in progress is cancelled, not waited for (the relay's
        stop must not wait for a broker that does not answer), and keeps no connection."""
        self._closes += 1
        self._opening.cancel()
        await self._forget()

    async def _forget(self) -> None:
        """Close the publisher's connection, the connect in progress left alone."""
        connection, self._connection, self._channel, self._exchange = (
            self._connection,
            None,
            None,
            None,
        )
        if connection is not None:
            await _close_quietly(connection)


async def _close_quietly(connection: AbstractConnection) -> None:
    if not connection.is_closed:
        # Closing a broken connection may fail; it is gone either way.
        with contextlib.suppress(Exception):
            await connection.close()


#: The connection a batch publishes on, its confirm-mode channel and the exchange.
_Link = tuple[AbstractConnection, AbstractChannel, AbstractExchange]
#: A message AMQP can carry, and its routing key.
_Sendable = tuple[OutboxMessage, "_Outgoing", str]


class _Outgoing:
    """What :func:`amqp_message` sends for an outbox row, its body and its AMQP properties, without
    the aio-pika message around them: that message sets each of its sixteen fields through a
    checking ``__setattr__`` and builds the properties again when read, some 6 % of the
    publisher's CPU time per message. aio-pika's publish reads only these two."""

    __slots__ = ("body", "properties")

    def __init__(self, message: OutboxMessage) -> None:
        headers: dict[str, Any] = message_headers(message)
        self.body = body(message)
        self.properties = Basic.Properties(
            content_type="application/json",
            delivery_mode=2,
            headers=headers,
            message_id=message.message_id,
            message_type=message.type,
            priority=0,
            timestamp=message.created_at,
        )

    def __repr__(self) -> str:
        return f"<AMQP message {self.properties.message_id}>"


def _answer(send: asyncio.Future[Any]) -> object:
    """What an ended send answered; a TimeoutError for one the batch's deadline cancelled."""
    if send.cancelled():
        return TimeoutError()
    return send.exception() or send.result()


def _no_answer(timeout: timedelta) -> str:
    return (
        f"RabbitMQ did not answer within {timeout.total_seconds():g} s (a connection the "
        "broker blocked for a memory or disk alarm opens no channel until the alarm clears)"
    )


def _too_large(size: int, limit: int) -> str:
    return f"its body of {size} bytes is above the broker's max_message_size of {limit} bytes"


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
