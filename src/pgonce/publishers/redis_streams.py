"""Redis Streams publisher: one ``XADD`` per row, the outbox id in the entry's ``message-id`` field.

The entry id is Redis's own (``*``): outbox ids of different aggregates reach a stream out of id
order when several relays run, and Redis refuses an explicit entry id lower than the stream's last.
Consumers dedupe on the ``message-id`` field. A batch goes in one pipeline (in order, one round
trip); each ``XADD`` that returned an entry id is acknowledged, an error reply is a refusal (and so
is a row the routing function raised for, or one with a field above the server's
``proto-max-bulk-len``, refused before it is sent while the rows of its aggregate behind it in the
batch wait for it), a lost connection leaves the batch unsettled, and
so does an error reply about the server's state rather than the entry (``READONLY`` after a
failover, ``OOM``, ``LOADING``, ``MISCONF``, ...). Redis acknowledges from memory: how durable an
acknowledged entry is depends on the server's ``appendonly``/``appendfsync`` settings.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Sequence
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
    check_timeout,
    route_or_refuse,
    short_error,
)

with needs("redis", "the Redis Streams publisher"):
    from redis import exceptions as redis_errors
    from redis.asyncio import Redis
    from redis.asyncio.connection import parse_url

#: The machine's Redis in development; in production this comes from configuration.
DEFAULT_URL = "redis://127.0.0.1:6379/0"
#: How long a connect or a batch's pipeline may take. Redis answers in milliseconds; a server that
#: stopped answering would otherwise hold the batch (and its rows' locks) for ever. After it the
#: batch is unsettled and published again (consumers dedupe on ``message-id``).
DEFAULT_TIMEOUT = timedelta(seconds=10)


#: Redis's default ``proto-max-bulk-len``: the largest field of a command it reads. Used where the
#: server does not let the client read its own (``CONFIG`` disabled, as on managed services).
DEFAULT_MAX_BULK = 512 * 1024 * 1024


#: Error replies that describe the server's state, not the entry: the write may succeed later.
_UNAVAILABLE_CODES = ("MISCONF", "NOREPLICAS", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN")


def _unavailable(reply: object) -> bool:
    if isinstance(
        reply,
        redis_errors.ReadOnlyError
        | redis_errors.OutOfMemoryError
        | redis_errors.BusyLoadingError
        | redis_errors.TryAgainError
        | redis_errors.ClusterDownError,
    ):
        return True
    return isinstance(reply, redis_errors.ResponseError) and str(reply).startswith(
        _UNAVAILABLE_CODES
    )


class RedisStreamsPublisher:
    """Appends to the stream ``routing(message)`` (default ``outbox.<aggregatetype>``).

    Fields: ``message-id``, ``type``, ``aggregatetype``, ``aggregateid``, ``payload`` (JSON) and
    ``headers`` (a JSON object). ``maxlen`` caps each stream approximately (``MAXLEN ~``); None
    keeps everything. Trimming does not wait for consumers: an entry trimmed before a consumer
    read it is gone for that consumer, so a cap must exceed what consumers can fall behind by.
    """

    name = "redis"

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        routing: Routing | None = None,
        maxlen: int | None = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        # Said at the start: each of these would otherwise raise out of every batch (redis-py
        # checks them only when the first command is built).
        scheme = urlsplit(url).scheme if isinstance(url, str) else ""
        if scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(
                "the Redis publisher's url must start with redis://, rediss:// or unix://, "
                f"not {scheme + '://' if scheme else 'no scheme'}"
            )
        try:
            parse_url(url)
        except ValueError:
            # redis-py reads the port and the query only when the client is made, at the first
            # batch. Its message is not repeated: it may quote the URL, password and all.
            raise ConfigError(
                "the Redis publisher's url is not one redis-py can read: a port that is not a "
                "number from 1 to 65535, or a query option of the wrong form"
            ) from None
        # MAXLEN ~ 0 keeps (about) nothing: every event acknowledged, then trimmed unread; and
        # True would be MAXLEN ~ 1.
        if maxlen is not None and (type(maxlen) is not int or maxlen < 1):
            raise ConfigError("the Redis publisher's maxlen must be at least 1, or None")
        check_timeout("the Redis publisher's timeout", timeout)
        self.url = url
        self.routing = routing or by_aggregatetype("outbox.")
        self.maxlen = maxlen
        self.timeout = timeout
        self._client: Redis | None = None
        #: The server's proto-max-bulk-len, read once per client.
        self._max_bulk: int | None = None

    async def prepare(self) -> None:
        """Connect now, so that a server that is down or a wrong URL is said at the relay's
        start, not with the first row; and connect again when :attr:`connected` says the
        connection was closed while idle."""
        client, _ = await self._connect()
        if not self.connected:
            # In a task of its own, awaited through a shield: a cancel (the relay's stop) ends
            # this at once, while redis-py, cancelled in its connect, may take up to its socket
            # timeout to give the half-made connection up; that is left to it.
            reconnect = asyncio.ensure_future(self._reconnect(client))
            try:
                await asyncio.shield(reconnect)
            except asyncio.CancelledError:
                reconnect.cancel()
                reconnect.add_done_callback(_settled)
                raise
            except (OSError, redis_errors.RedisError) as error:
                await self.close()
                raise BrokerUnavailable(f"Redis: {short_error(error)}") from error

    @property
    def connected(self) -> bool:
        """Whether a batch would go out on an open connection, without connecting first: False
        before the first connect, and when a connection idle in redis-py's pool was closed by
        the server or the network (an idle timeout, a restart, a cut).

        No I/O: asyncio's transport reads an idle connection's socket all along, so the server's
        close is already in its stream (end of file, or the reset's error); redis-py would see it
        only in the next command, and reconnect there, inside publish(). A connection in use by
        another batch is not judged, and none idle (all in use by batches at the broker at once)
        is no closed connection: the pool makes one in publish(), as it always did.
        """
        client = self._client
        if client is None or self._max_bulk is None:
            return False
        idle = _idle(client)
        if idle is None:
            # A redis-py whose pool is not as read here: taken for connected, as before.
            return True
        return all(_open(connection) for connection in idle)

    async def _reconnect(self, client: Redis) -> None:
        """Drop the pool's idle connections the server closed, and connect one if none is left,
        so that the next batch sends at once (a stop cancels this; it would wait for publish())."""
        idle = _idle(client)
        if idle is None:
            return
        # Taken out of the pool before any await: no batch takes one of them meanwhile.
        closed = [connection for connection in idle if not _open(connection)]
        for connection in closed:
            idle.remove(connection)
        for connection in closed:
            # Closes the socket without waiting: the server is gone from it.
            await connection.disconnect(nowait=True)
        if not idle:
            # A new connection through the pool, connected within the timeout, left idle in it.
            await client.ping()

    async def _connect(self) -> tuple[Redis, int]:
        """The client, and the server's proto-max-bulk-len (which takes a connection)."""
        if self._client is None:
            seconds = self.timeout.total_seconds()
            self._client = Redis.from_url(
                self.url, socket_connect_timeout=seconds, socket_timeout=seconds
            )
        try:
            return self._client, await self._read_max_bulk(self._client)
        except (OSError, redis_errors.RedisError) as error:
            await self.close()
            raise BrokerUnavailable(f"Redis: {short_error(error)}") from error

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        client, max_bulk = await self._connect()
        pipe = client.pipeline(transaction=False)
        refused: dict[int, str] = {}
        kinds: dict[int, str] = {}
        sent: list[tuple[OutboxMessage, str]] = []
        # Aggregates with a row the routing function raised for: their later rows wait behind it.
        held: set[tuple[str, str]] = set()
        for message in batch:
            if held and (message.aggregatetype, message.aggregateid) in held:
                continue
            key = route_or_refuse(self.routing, message, refused, kinds)
            if key is None:
                held.add((message.aggregatetype, message.aggregateid))
                continue
            fields: dict[bytes | bytearray | memoryview[int] | str | int | float, Any] = {
                "message-id": message.message_id,
                "type": message.type,
                "aggregatetype": message.aggregatetype,
                "aggregateid": message.aggregateid,
                "payload": body(message),
                "headers": json.dumps(dict(message.headers), separators=(",", ":")),
            }
            # The server closes the connection for a field above its limit: taken for an
            # outage, the row would fail every batch that holds it, never parked, and the rows
            # before it in the pipeline would be appended again at every retry.
            largest = _above(max_bulk, key, fields.values())
            if largest is not None:
                refused[message.id] = (
                    f"Redis cannot take the entry: its largest field of {largest} bytes is "
                    f"above the server's proto-max-bulk-len of {max_bulk} bytes"
                )
                kinds[message.id] = "too_large"
                held.add((message.aggregatetype, message.aggregateid))
                continue
            sent.append((message, key))
            pipe.xadd(key, fields, maxlen=self.maxlen, approximate=True)
        if not sent:
            return PublishResult(refused=refused, kinds=kinds)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except (OSError, redis_errors.RedisError) as error:
            # With raise_on_error=False an entry's own error is a reply; what is raised is about
            # the connection: lost, timed out, or refused at its set-up (a wrong password, a
            # database number the server lacks). The rows wait for it to be fixed.
            await self.close()
            raise BrokerUnavailable(f"Redis: {short_error(error)}") from error
        acked: set[int] = set()
        lost: str | None = None
        for (message, key), reply in zip(sent, replies, strict=True):
            if _unavailable(reply):
                # The server cannot take writes now (a replica after a failover, out of
                # memory, loading): an outage, not a refusal of this row. Counted as attempts,
                # a failover would park the whole backlog.
                lost = f"Redis cannot take writes now: {short_error(reply)}"
            elif isinstance(reply, BaseException):
                # The key is named: WRONGTYPE (a key of another type where the stream should
                # be) says which kind of value, not which key, and the routing chose it.
                refused[message.id] = f"Redis refused XADD to {key!r}: {short_error(reply)}"
            else:
                acked.add(message.id)
        if lost:
            # The next batch connects afresh: after a failover the URL may lead to the new
            # primary.
            await self.close()
        return PublishResult(frozenset(acked), refused, kinds, lost)

    async def _read_max_bulk(self, client: Redis) -> int:
        """The server's proto-max-bulk-len, or Redis's default where it may not be read."""
        if self._max_bulk is None:
            # A refusal of the connection's set-up (a wrong password, a database number the
            # server lacks) is raised here, not taken for a refusal of CONFIG below.
            await client.ping()
            try:
                reply = await client.config_get("proto-max-bulk-len")
                value = reply.get("proto-max-bulk-len")
                self._max_bulk = int(value) if isinstance(value, str | bytes) else DEFAULT_MAX_BULK
            except (redis_errors.ResponseError, ValueError):
                # CONFIG refused (disabled, or not in the user's ACL): the default holds, and
                # a lower limit shows as a closed connection.
                self._max_bulk = DEFAULT_MAX_BULK
        return self._max_bulk

    async def close(self) -> None:
        client, self._client, self._max_bulk = self._client, None, None
        if client is not None:
            await client.aclose()


def _settled(task: asyncio.Future[None]) -> None:
    """A reconnect given up at a stop has ended: what it raised is of no use to anyone."""
    if not task.cancelled():
        task.exception()


def _idle(client: Redis) -> list[Any] | None:
    """The connections idle in ``client``'s pool (the list itself), or None for a pool that
    does not keep them so."""
    idle = getattr(client.connection_pool, "_available_connections", None)
    return idle if isinstance(idle, list) else None


def _open(connection: object) -> bool:
    """Whether a pooled connection is open, from what asyncio already read from its socket (no
    I/O): True unless redis-py disconnected it, or the server's end of file or a reset (or any
    error) reached its stream. A connection not made of asyncio streams is taken for open."""
    reader = getattr(connection, "_reader", _UNKNOWN)
    writer = getattr(connection, "_writer", _UNKNOWN)
    if reader is _UNKNOWN or writer is _UNKNOWN:
        return True
    if reader is None or writer is None:
        return False
    if not isinstance(reader, asyncio.StreamReader) or not isinstance(writer, asyncio.StreamWriter):
        return True
    return not (reader.at_eof() or reader.exception() is not None or writer.is_closing())


_UNKNOWN = object()


def _above(limit: int, key: str, values: Iterable[object]) -> int | None:
    """The bytes of the largest argument of an ``XADD`` to ``key`` with these field values, if
    it is above ``limit``; None otherwise."""
    largest = 0
    for value in (key, *values):
        if isinstance(value, bytes):
            size = len(value)
        elif len(text := str(value)) * 4 <= limit:
            # UTF-8 takes at most 4 bytes a character: no need to encode it to know.
            continue
        else:
            size = len(text.encode())
        largest = max(largest, size)
    return largest if largest > limit else None
