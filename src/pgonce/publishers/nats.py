"""NATS JetStream publisher (nats-py), deduplicated by ``Nats-Msg-Id``.

Each message carries the outbox id in ``Nats-Msg-Id``, after the outbox's origin and a colon
(``3f2a9c01b7de:42``): JetStream drops a second message with the same id inside the stream's
duplicate window (2 minutes by default), so a relay that published a batch and died before
marking it does not even create a duplicate on the stream when the next relay publishes again
within the window. The outbox id is unique within one outbox only; the origin
(:func:`~pgonce.publishers.base.outbox_origin`, which the relay reads from the database when it
starts: the cluster's system identifier, the database and the schema) puts each outbox's ids
apart, so that two outboxes publishing into one stream do not have one's event dropped as a
duplicate of the other's (and acknowledged). The same row keeps its id whatever relay publishes
it, a physical standby's after a failover included. An explicit ``msg_id_prefix`` replaces the
origin and its colon (``billing:42``); a publisher used without a relay and without a prefix
sends the bare outbox id.

A batch is pipelined on one connection (the stream stores it in order) and a message counts as
acknowledged when its PubAck arrived (a PubAck flagged ``duplicate`` is an acknowledgement too:
the stream has the message). An error answer (no stream
for the subject, a stream limit) is a refusal, and so is a message the client cannot send (a
payload above the server's ``max_payload``, an invalid subject or header) or one the routing
function raised for, refused before it is sent (the rows of its aggregate behind it in the batch
are not sent and wait for it); a timeout or a lost connection leaves the message unsettled.

The PubAcks are collected here rather than through ``JetStreamContext.publish_async``: every
message is a core ``publish`` whose reply subject ends in a token of this connection, one
subscription on the connection's inbox receives the answers, and a batch waits for one event
instead of a future per message. The protocol is JetStream's own (a publish with a reply subject
is how every client asks for a PubAck); what goes away is the per-message bookkeeping of the
generic API -- a semaphore, a random token, a future with its callback and a parsed ``PubAck``
object -- which took more than half of a relay's CPU per event
(``make bench BENCH_ARGS="--only outbox"`` measures both loops).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Sequence
from datetime import timedelta
from urllib.parse import urlsplit

from pgonce.core.checks import describe
from pgonce.core.outbox import OutboxMessage
from pgonce.errors import BrokerUnavailable, ConfigError, UsageError
from pgonce.extras import needs
from pgonce.publishers.base import (
    PublishResult,
    Routing,
    SharedConnect,
    body,
    by_aggregatetype,
    check_timeout,
    message_headers,
    msg_id_prefix_problem,
    route_or_refuse,
    short_error,
    url_origin,
)

with needs("nats", "the NATS publisher"):
    import nats
    import nats.errors
    from nats.aio.client import Client
    from nats.aio.msg import Msg

#: The machine's NATS server in development; in production this comes from configuration.
DEFAULT_SERVERS = "nats://127.0.0.1:4222"
#: How long a batch waits for its PubAcks; a healthy server answers in milliseconds.
DEFAULT_ACK_TIMEOUT = timedelta(seconds=10)
log = logging.getLogger("pgonce.publishers.nats")

#: JetStream's header for publish deduplication.
MSG_ID_HEADER = "Nats-Msg-Id"
#: The status a NATS server answers a request with when nothing subscribes to its subject; for a
#: JetStream publish, when no stream covers the subject.
NO_RESPONDERS = "503"


class _Pending:
    """One batch's outstanding PubAcks."""

    __slots__ = ("acked", "done", "foreign", "left", "refused")

    def __init__(self, size: int) -> None:
        self.acked: set[int] = set()
        self.refused: dict[int, str] = {}
        #: Rows answered by something other than JetStream, still waiting for a PubAck.
        self.foreign: set[int] = set()
        self.left = size
        self.done = asyncio.Event()
        if not size:
            self.done.set()

    def settle(self) -> None:
        self.left -= 1
        if not self.left:
            self.done.set()


class _Connection:
    """A connection, its inbox subscription and the messages awaiting their PubAck by token."""

    def __init__(self, client: Client, inbox: str) -> None:
        self.client = client
        self.inbox = inbox
        self.tokens = itertools.count()
        #: By token: the batch, the row's id and its subject (named in a refusal).
        self.waiting: dict[str, tuple[_Pending, int, str]] = {}
        self._cut = len(inbox) + 1

    async def on_reply(self, msg: Msg) -> None:
        token = msg.subject[self._cut :]
        entry = self.waiting.pop(token, None)
        if entry is None:
            # The answer to a batch that stopped waiting: that row stays unsettled and goes
            # again with the same Nats-Msg-Id, which the stream drops as a duplicate.
            return
        pending, message_id, subject = entry
        reason = _refusal(msg, subject)
        if reason is None:
            pending.acked.add(message_id)
        elif reason is _NOT_JETSTREAM:
            # A subscriber of the subject answered, not a stream. One may cover the subject
            # too, and its PubAck is still to come: the row waits for it (see publish()).
            self.waiting[token] = entry
            pending.foreign.add(message_id)
            return
        else:
            pending.refused[message_id] = reason
        pending.settle()

    def abandon(self) -> None:
        """The connection is gone: every batch still waiting stops waiting now."""
        waiting, self.waiting = self.waiting, {}
        for pending, _, _ in waiting.values():
            pending.done.set()


def _refusal(msg: Msg, subject: str) -> str | None:
    """None for a PubAck, the reason for an error answer, or for an answer that is not
    JetStream's (``subject`` is named where the subject is the cause)."""
    headers = msg.headers or {}
    status = headers.get("Status")
    if status == NO_RESPONDERS:
        return f"JetStream refused the message: no stream covers the subject {subject!r}"
    if status is not None:
        description = headers.get("Description", "")
        return f"JetStream refused the message: status {status} {description}".rstrip()
    # A PubAck is {"stream": ..., "seq": ...}; only an answer that mentions an error is parsed.
    data = msg.data
    if b'"error"' not in data:
        # Anything else is a subscriber of the subject answering (a core NATS service): taken
        # for a PubAck, the row would be marked published while no stream stored it.
        return None if b'"stream"' in data and b'"seq"' in data else _NOT_JETSTREAM
    try:
        answer = json.loads(msg.data)
    except ValueError:
        return f"JetStream answered something that is not JSON: {msg.data[:200]!r}"
    error = answer.get("error") if isinstance(answer, dict) else None
    if error is None:
        return None
    description = error.get("description", error) if isinstance(error, dict) else error
    return f"JetStream refused the message: {description}"


#: What _refusal() returns for an answer that is not JetStream's (compared by identity).
_NOT_JETSTREAM = "not a JetStream acknowledgement"


#: The URL schemes nats-py connects with; a URL without one is taken as ``nats://``.
_SCHEMES = ("nats", "tls", "ws", "wss")


def _check_servers(servers: object) -> None:
    """Refuse, at the start, servers nats-py could never connect to.

    nats-py reads them only when it connects, and takes a URL of another scheme
    (``amqp://guest:guest@host:5672``) for a host named after the scheme: every batch would then
    wait "unavailable", retried for ever, instead of the relay refusing its configuration.
    """
    urls = [servers] if isinstance(servers, str) else servers
    if not isinstance(urls, list) or not urls:
        raise ConfigError(
            f"the NATS publisher's servers must be a URL or a list of URLs, not {describe(servers)}"
        )
    for url in urls:
        try:
            text = url if "://" in url else f"nats://{url}"
            parts = urlsplit(text)
            # .port raises ValueError for a port that is not a number or is above 65535.
            valid = parts.scheme in _SCHEMES and bool(parts.hostname) and parts.port != 0
        except (ValueError, TypeError, AttributeError):
            valid = False
        if not valid:
            shown = url_origin(url) if isinstance(url, str) else describe(url)
            raise ConfigError(
                "the NATS publisher's url must be a nats://, tls://, ws:// or wss:// URL with a "
                f"host and a valid port, not {shown}"
            )


class NatsPublisher:
    """Publishes to subject ``routing(message)`` (default ``outbox.<aggregatetype>``); a stream
    must cover the subjects (the publisher does not create streams: their limits are an operator's
    decision)."""

    name = "nats"

    def __init__(
        self,
        servers: str | list[str] = DEFAULT_SERVERS,
        *,
        routing: Routing | None = None,
        ack_timeout: timedelta = DEFAULT_ACK_TIMEOUT,
        msg_id_prefix: str = "",
    ) -> None:
        check_timeout("the NATS publisher's ack_timeout", ack_timeout)
        _check_servers(servers)
        problem = msg_id_prefix_problem(msg_id_prefix)
        if problem is not None:
            raise ConfigError(f"the NATS publisher's msg_id_prefix {problem}")
        #: Put before the outbox id in ``Nats-Msg-Id`` instead of the outbox's origin: the outbox
        #: id is unique within one outbox only, and JetStream drops a second message with an id
        #: it already stored.
        self.msg_id_prefix = msg_id_prefix
        #: What comes before the outbox id in ``Nats-Msg-Id``: the prefix, else the origin the
        #: relay gives (see set_origin()) and a colon, else nothing.
        self._id_prefix = msg_id_prefix
        #: The origin the relay gave, once it has.
        self._origin: str | None = None
        self.servers = servers
        self.routing = routing or by_aggregatetype("outbox.")
        self.ack_timeout = ack_timeout
        self._connection: _Connection | None = None
        #: The connect in progress, which every batch without a connection waits for.
        self._opening = SharedConnect[_Connection]("NATS")
        #: Counts the closes: a connect that finishes after one keeps no connection.
        self._closes = 0

    def set_origin(self, origin: str) -> None:
        """Put the outbox's origin (see :func:`~pgonce.publishers.base.outbox_origin`) before
        the outbox id in ``Nats-Msg-Id``, unless a ``msg_id_prefix`` was given: the relay calls
        it before its first batch."""
        problem = msg_id_prefix_problem(origin)
        if problem is not None or not origin:
            raise ConfigError(f"the outbox's origin {problem or 'must not be empty'}")
        if self._origin is not None and self._origin != origin:
            # Relays of two outboxes sharing this publisher: the ids of one would name the
            # other, and JetStream would drop one outbox's row as a duplicate of the other's.
            raise UsageError(
                "one NatsPublisher serves one outbox: it was given to relays of two (another "
                "database or schema); give each relay a publisher of its own"
            )
        self._origin = origin
        if not self.msg_id_prefix:
            self._id_prefix = f"{origin}:"

    async def prepare(self) -> None:
        """Connect now, so that a server that is down or a wrong address is said at the relay's
        start, not with the first row."""
        await self._connect()

    @property
    def connected(self) -> bool:
        """Whether a batch would go out on an open connection: nats-py's own state, which a
        server's close or a cut changes (the client does not reconnect by itself), idle or not."""
        connection = self._connection
        return connection is not None and connection.client.is_connected

    async def _connect(self) -> _Connection:
        connection = self._connection
        if connection is not None and connection.client.is_connected:
            return connection
        return await self._wait_for_connect()

    async def _wait_for_connect(self) -> _Connection:
        """The connection of the connect in progress, or of a new one (:class:`SharedConnect`:
        nats-py makes its TCP connection inside ``asyncio.wait_for()``, which on Python 3.11
        could otherwise lose a stop's cancel, which then waited for the connect timeout against
        a server that accepts and does not answer)."""
        return await self._opening.wait(self._reopen)

    async def _reopen(self) -> _Connection:
        closes = self._closes
        await self._forget()
        connection = await self._open()
        if closes != self._closes:
            # close() came while this connect was on its way (and its cancel did not reach it):
            # the publisher is closed, and keeps no connection.
            with contextlib.suppress(Exception):
                await connection.client.close()
            raise BrokerUnavailable("NATS: the publisher was closed while it connected")
        self._connection = connection
        return connection

    async def _open(self) -> _Connection:
        connection: _Connection | None = None
        #: What nats-py last reported: its NoServersError, raised in the end, says no more.
        reported: list[Exception] = []

        async def closed() -> None:
            if connection is not None:
                connection.abandon()

        async def on_error(error: Exception) -> None:
            reported[:] = [error]
            await _log_error(error)

        # Built here rather than by nats.connect(), which drops the client when its connect
        # fails or is cancelled: after the TCP connection is made (nats-py then waits for the
        # server's INFO), that left the socket open until the garbage collector found it.
        client = Client()
        # No background reconnect: a lost connection must surface as unsettled messages now,
        # and the next batch connects afresh.
        # (max_reconnect_attempts=0 would make the first connect retry forever.)
        connecting = asyncio.ensure_future(
            client.connect(
                self.servers,
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0,
                connect_timeout=5,
                error_cb=on_error,
                disconnected_cb=closed,
                closed_cb=closed,
            )
        )
        try:
            try:
                # Awaited through asyncio.wait(): a cancel of this task is never lost here.
                await asyncio.wait({connecting})
            except asyncio.CancelledError:
                await _end(connecting, client)
                raise
            connecting.result()
        except BaseException as error:
            # A cancel (close() at a stop) as much as a failure: the half-made connection goes.
            _close_transport(client)
            if not isinstance(error, (OSError, TimeoutError, nats.errors.Error)):
                raise
            if isinstance(error, nats.errors.NoServersError) and reported:
                raise BrokerUnavailable(
                    f"NATS: no server could be reached ({short_error(reported[0])})"
                ) from error
            raise BrokerUnavailable(f"NATS: {short_error(error)}") from error
        connection = _Connection(client, client.new_inbox())
        try:
            await client.subscribe(f"{connection.inbox}.*", cb=connection.on_reply)
        except BaseException as error:
            # A cancel (close() at a stop) leaves no connection open behind it either.
            with contextlib.suppress(Exception):
                await client.close()
            if isinstance(error, (OSError, nats.errors.Error)):
                raise BrokerUnavailable(f"NATS: {short_error(error)}") from error
            raise
        return connection

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        connection = await self._connect()
        pending = _Pending(len(batch))
        tokens: list[str] = []
        lost: str | None = None
        client, waiting, inbox, next_token = (
            connection.client,
            connection.waiting,
            connection.inbox,
            connection.tokens,
        )
        kinds: dict[int, str] = {}
        # Aggregates with a row refused before it was sent: their later rows wait behind it.
        held: set[tuple[str, str]] = set()
        max_payload = client.max_payload
        msg_id_prefix = self._id_prefix
        try:
            for message in batch:
                if held and (message.aggregatetype, message.aggregateid) in held:
                    pending.settle()
                    continue
                # A row the routing function fails for is refused: this row's failure, not
                # the batch's; it is parked in the end while every other aggregate goes on.
                subject = route_or_refuse(self.routing, message, pending.refused, kinds)
                if subject is None:
                    held.add((message.aggregatetype, message.aggregateid))
                    pending.settle()
                    continue
                headers = message_headers(message)
                headers[MSG_ID_HEADER] = msg_id_prefix + message.message_id
                token = str(next(next_token))
                waiting[token] = (pending, message.id, subject)
                tokens.append(token)
                payload = body(message)
                try:
                    # The server counts the headers too, and closes the connection for a
                    # message above max_payload (the client checks only the payload).
                    if (message.headers or len(payload) > max_payload - _HEADROOM) and (
                        _size(payload, headers) > max_payload
                    ):
                        raise nats.errors.MaxPayloadError
                    await client.publish(
                        subject, payload, reply=f"{inbox}.{token}", headers=headers
                    )
                except _UNSENDABLE as error:
                    # Raised by the client before a byte is sent, for this message alone. Taken
                    # for a broken connection, the row would stay unsettled for ever and every
                    # batch would stop at it; refused, it counts attempts (and is parked in the
                    # end) while the rest goes on.
                    del waiting[token]
                    tokens.pop()
                    size = _size(payload, headers)
                    pending.refused[message.id] = _unsendable(error, size, max_payload)
                    kinds[message.id] = "unsendable"
                    held.add((message.aggregatetype, message.aggregateid))
                    pending.settle()
        except (OSError, nats.errors.Error) as error:
            # The connection broke mid-batch: what was not sent is unsettled, and no answer
            # comes for what was.
            lost = f"NATS: the connection broke mid-batch ({short_error(error)})"
        if not lost:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.ack_timeout.total_seconds()):
                    await pending.done.wait()
        broke = lost is not None or not connection.client.is_connected
        seconds = self.ack_timeout.total_seconds()
        for token in tokens:
            entry = waiting.pop(token, None)
            if entry is None:
                continue
            if entry[1] in pending.foreign and not broke:
                # Only a subscriber answered, and no stream within the wait: a refusal (the row
                # is parked in the end), not an outage that waits for ever, nor an ack.
                pending.refused[entry[1]] = (
                    f"no stream covers the subject {entry[2]!r}: a subscriber of it answered "
                    f"the message, and no JetStream acknowledgement came within {seconds:g} s"
                )
            elif lost is None:
                lost = f"no acknowledgement from JetStream within {seconds:g} s for {entry[2]!r}"
                if not pending.acked:
                    # Nothing answered at all: the server would have said "no responders" if
                    # nothing took the subject, so either JetStream is slow or down, or a plain
                    # subscriber takes the subject and no stream does.
                    lost += (
                        ": JetStream is slow or unavailable, or no stream covers the subject "
                        "and a subscriber that is not a stream took the message"
                    )
        if lost or not connection.client.is_connected:
            await self._drop(connection)
        return PublishResult(frozenset(pending.acked), pending.refused, kinds, lost)

    async def _drop(self, connection: _Connection) -> None:
        """Close a batch's connection that broke; the publisher's own only if it is still that
        one (another batch may have connected since)."""
        if connection is self._connection:
            self._connection = None
        await _close_quietly(connection)

    async def close(self) -> None:
        """Close the connection; a connect in progress is cancelled, not waited for (the relay's
        stop must not wait for a server that does not answer), and keeps no connection."""
        self._closes += 1
        self._opening.cancel()
        await self._forget()

    async def _forget(self) -> None:
        """Close the publisher's connection, the connect in progress left alone."""
        connection, self._connection = self._connection, None
        if connection is not None:
            await _close_quietly(connection)


async def _end(connecting: asyncio.Future[None], client: Client) -> None:
    """End nats-py's cancelled connect, and wait for it.

    nats-py makes its TCP connection inside ``asyncio.wait_for()``, which on Python 3.11 loses a
    cancel that lands as the connection is made: the connect then waits for the server's INFO
    until its own timeout (5 s), a task left running after the stop. The cancel is sent again at
    every loop turn until the connect has ended, and its socket closed meanwhile."""
    while not connecting.done():
        connecting.cancel()
        _close_transport(client)
        # A second cancel of this task (its caller's own) is raised by the caller all the same.
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)
    if not connecting.cancelled():
        connecting.exception()  # retrieved: the cancel is what is said


def _close_transport(client: Client) -> None:
    """Close the socket of a client whose connect did not complete, at once and without a wait
    (a cancelled task must not wait; nats-py's close() expects a connected client)."""
    transport = getattr(client, "_transport", None)
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()


async def _close_quietly(connection: _Connection) -> None:
    if not connection.client.is_closed:
        # Closing a broken connection may fail; it is gone either way.
        with contextlib.suppress(Exception):
            await connection.client.close()


#: What nats-py raises for one message it refuses to send: its payload, subject or headers.
_UNSENDABLE = (
    nats.errors.MaxPayloadError,
    nats.errors.BadSubjectError,
    nats.errors.BadHeaderError,
)


#: More than the outbox facts take in a message's headers (their names are bounded in bytes by
#: the table): a payload this far below max_payload needs no count of its headers' bytes when
#: the caller gave none.
_HEADROOM = 4096


def _size(payload: bytes, headers: dict[str, str]) -> int:
    """The bytes the server counts against max_payload: the payload and the encoded headers
    (``NATS/1.0``, a line per header, an empty line)."""
    lines = sum(len(k.encode()) + len(v.encode()) + 4 for k, v in headers.items())
    return len(payload) + 12 + lines


def _unsendable(error: Exception, size: int, max_payload: int) -> str:
    if isinstance(error, nats.errors.MaxPayloadError):
        return (
            f"the message of {size} bytes (payload and headers) is above the NATS server's "
            f"max_payload of {max_payload} bytes"
        )
    what = "subject" if isinstance(error, nats.errors.BadSubjectError) else "header"
    return f"NATS cannot send the message: an invalid {what} ({short_error(error)})"


async def _log_error(error: Exception) -> None:
    # nats-py reports connection errors here as well as raising them; the relay already logs
    # the raised one, so this is detail for debugging only.
    log.debug("NATS client error: %s", error)
