"""The one small interface between the outbox relay and a broker.

A publisher receives a batch in id order and answers, per row, **acknowledged** (the broker took
responsibility for it), **refused** (the broker or endpoint answered no; the relay counts an
attempt) or nothing at all (unsettled: the outcome is unknown, e.g. the connection dropped; the
row is retried without counting an attempt). Raising :class:`~pgonce.errors.BrokerUnavailable`
means the whole batch is unsettled. A publisher never marks anything in the database: the relay
does, in the claim's transaction, only for what the publisher reported acknowledged.

Adding a broker (Kafka is the obvious next one: ``enable.idempotence`` and the outbox id as the
record key or a header) means writing one class with :meth:`Publisher.publish` and
:meth:`Publisher.close`, and a test against a real broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import hashlib
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import urlsplit

from pgonce.core.checks import describe
from pgonce.core.frozen import refuse_changes
from pgonce.core.outbox import OutboxMessage
from pgonce.errors import BrokerUnavailable, ConfigError

T = TypeVar("T")


@refuse_changes
@dataclass(frozen=True, slots=True)
class PublishResult:
    """The broker's answer to a batch: acknowledged ids, and refused ids with the reason.

    ``kinds`` names the kind of each refusal for logs and metrics (``"unroutable"``,
    ``"nacked"``, ...; ``"refused"`` when absent); ``lost`` says why the rows that got no answer
    got none (``"timeout: ..."``, a dropped connection), when the publisher knows.
    """

    acked: frozenset[int] = frozenset()
    refused: Mapping[int, str] = field(default_factory=dict)
    kinds: Mapping[int, str] = field(default_factory=dict)
    lost: str | None = None


class Publisher(Protocol):
    """What the relay calls: :meth:`publish` and :meth:`close`, and two optional members.

    ``async def prepare(self) -> None``, when present, connects (and checks what it can) before
    the first batch, and again before a batch when the publisher is not connected; a stop cancels
    it at once, as nothing was sent.

    ``connected`` (a property), when present, is True when a send would go out on an open
    connection without connecting first, from the client's own state; False when the connection
    closed (the broker closed an idle connection, restarted, or the network cut it), so that the
    relay calls ``prepare()`` before the batch instead of counting a connect inside
    :meth:`publish` as rows at the broker, which a stop waits for. It is read once per batch and
    must not wait or do I/O. A publisher without it is taken for connected until a batch reports
    ``lost``.

    ``reports_sending`` (a bool attribute), when True, says that :meth:`publish` calls
    :func:`sending` just before the first bytes of a row go out (after any connect it makes on
    the way). Until it does, the relay counts the batch as "connecting", not as rows at the
    broker: a stop cancels :meth:`publish` at once, the claim rolls back and the rows wait for
    the next run, untouched (nothing was sent: nothing is marked, no attempt is counted). A
    publisher that connects inside :meth:`publish` (to a destination its routing function
    names, or through a proxy) says so; without it, a stop during such a connect waits for the
    batch up to its grace.

    ``def set_origin(self, origin: str) -> None``, when present, is called by the relay before
    its first batch with the outbox's origin (:func:`outbox_origin`): a short text naming the
    outbox the rows come from, the same for the same outbox whatever relay publishes it. A
    publisher whose broker deduplicates by a message id (JetStream's ``Nats-Msg-Id``) puts it in
    the id, so that two outboxes' row 1 do not take each other for a redelivery. A publisher
    serves one outbox: given another origin after the first, it raises
    :class:`~pgonce.errors.UsageError`.
    """

    #: Short name for logs and metrics: "rabbitmq", "nats", "redis", "http".
    name: str

    async def publish(self, batch: Sequence[OutboxMessage]) -> PublishResult:
        """Publish ``batch`` in order; return what the broker acknowledged or refused."""
        ...

    async def close(self) -> None:
        """Release the broker connection; the publisher may be used again (it reconnects)."""
        ...


#: The relay's "a row is going out" signal for the batch in publish(), in that batch's context
#: (and so in the tasks publish() starts); see :func:`sending`.
_SENT: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "pgonce_sent", default=None
)


def sending() -> None:
    """Say, from inside :meth:`Publisher.publish`, that a row of the batch is going out now:
    from here a stop gives the batch its grace to be answered (see ``reports_sending``). Called
    again, or outside a relay's batch, it does nothing."""
    signal = _SENT.get()
    if signal is not None:
        signal()


@contextlib.contextmanager
def on_sending(signal: Callable[[], None]) -> Iterator[None]:
    """Within the block, :func:`sending` in this context calls ``signal`` (the relay's, around
    one batch's publish())."""
    token = _SENT.set(signal)
    try:
        yield
    finally:
        _SENT.reset(token)


def body(message: OutboxMessage) -> bytes:
    """The message body: the payload's JSON text as the outbox stores it, in UTF-8."""
    return message.payload_json.encode()


def message_headers(message: OutboxMessage) -> dict[str, str]:
    """Headers every broker carries: the caller's, then the outbox facts (which win on a clash).

    ``message-id`` duplicates the broker's own id field for consumers that only read headers.
    """
    return {
        **message.headers,
        "message-id": message.message_id,
        "type": message.type,
        "aggregatetype": message.aggregatetype,
        "aggregateid": message.aggregateid,
    }


#: Hex digits of the hash kept in an outbox's origin: 48 bits, for a handful of outboxes sharing
#: a destination.
ORIGIN_DIGITS = 12


def outbox_origin(system_identifier: str, database: str, schema: str) -> str:
    """The origin of an outbox: a hash of the PostgreSQL cluster's system identifier
    (``pg_control_system()``, the same on a physical standby, so a failover keeps it), the
    database's name and the pgonce schema's, as :data:`ORIGIN_DIGITS` hex digits.

    The outbox id is unique within one outbox only; the origin and the id together are unique
    across outboxes, and the same again when another relay (after a crash, a restart or a
    failover) publishes the same row.
    """
    text = "\0".join((system_identifier, database, schema))
    return hashlib.sha256(text.encode()).hexdigest()[:ORIGIN_DIGITS]


def msg_id_prefix_problem(prefix: object) -> str | None:
    """Why ``prefix`` cannot start a message id in a header (a str without spaces or control
    characters), or None when it can."""
    if isinstance(prefix, str) and not any(c.isspace() or not c.isprintable() for c in prefix):
        return None
    shown = repr(prefix) if isinstance(prefix, str) else describe(prefix)
    return f"must be a string without spaces or control characters, not {shown}"


def by_aggregatetype(prefix: str) -> Routing:
    """Routing that names the destination ``<prefix><aggregatetype>`` (Debezium's default shape)."""

    def route(message: OutboxMessage) -> str:
        return f"{prefix}{message.aggregatetype}"

    return route


class Routing(Protocol):
    def __call__(self, message: OutboxMessage) -> str: ...


#: The kind of a refusal for a row the routing function raised for (or gave no name for).
ROUTING_FAILED = "routing_failed"
#: Most characters of the routing function's exception message kept in a refusal's reason.
_ROUTING_ERROR_CHARS = 200


def routing_refusal(outcome: object) -> str:
    """The reason a row is refused when the routing function raised ``outcome`` for it, or
    returned ``outcome``, which is not a ``str``.

    A routing function that raises for one row (an aggregate type it does not know) is that
    row's failure: refused, it counts attempts and is parked in the end while every other row is
    published. Raised out of the batch, it would fail every batch that holds the row, without an
    attempt counted, and stop every aggregate behind it. The reason names the exception's class
    and the first line of its message, cut short; never the row itself.
    """
    if isinstance(outcome, BaseException):
        text = short_error(outcome)
        if len(text) > _ROUTING_ERROR_CHARS:
            text = text[:_ROUTING_ERROR_CHARS] + "..."
        return f"the routing function raised {text}"
    return f"the routing function returned {type(outcome).__name__}, not a str"


def route_or_refuse(
    routing: Routing, message: OutboxMessage, refused: dict[int, str], kinds: dict[int, str]
) -> str | None:
    """The destination ``routing`` names for ``message``; or, when the routing function raised
    for it or returned something other than a ``str``, ``None`` after refusing the row into
    ``refused`` (the reason, see :func:`routing_refusal`) and ``kinds`` (``ROUTING_FAILED``).

    The caller skips a refused row; one that keeps per-aggregate order also holds the row's
    aggregate back for the rest of the batch.
    """
    try:
        outcome: object = routing(message)
    except Exception as error:
        outcome = error
    if isinstance(outcome, str):
        return outcome
    refused[message.id] = routing_refusal(outcome)
    kinds[message.id] = ROUTING_FAILED
    return None


def check_timeout(what: str, timeout: object) -> None:
    """Refuse a publisher's wait that is not a positive timedelta (``what`` names the setting).

    A number of seconds would otherwise escape as a bare TypeError from the comparison, and a wait
    of nothing would leave every batch unsettled, retried for ever.
    """
    if not isinstance(timeout, timedelta):
        raise ConfigError(
            f"{what} must be a timedelta (such as timedelta(seconds=10)), "
            f"not {type(timeout).__name__}"
        )
    if not timeout > timedelta(0):
        raise ConfigError(f"{what} must be above 0")


def short_error(error: BaseException) -> str:
    """A one-line reason for ``last_error``: the class and the first line of the message,
    without a closing period (redis-py's "Connection closed by server."): the reason is joined
    with "; " into longer lines, which would read ".;"."""
    text = str(error).strip().splitlines()
    if not text:
        return type(error).__name__
    first = text[0].rstrip()
    if first.endswith(".") and not first.endswith(".."):
        first = first[:-1]
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def url_origin(url: str) -> str:
    """Scheme, host and port of ``url``: what an error or ``last_error`` may show of it. Its
    user and password, path and query may carry a credential."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "an invalid URL"
    if not parts.scheme or not parts.hostname:
        return "an invalid URL"
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


class SharedConnect(Generic[T]):
    """One connect in progress at a time, shared by the relay's concurrent batch loops: every
    batch without a connection waits for the same one, and when it fails they all fail with it,
    at once (each used to wait its turn and then its own connect timeout).

    The connect runs in a task of its own, awaited through :func:`asyncio.wait`, never directly:
    a batch cancelled at a stop returns at once and leaves the connect to the others. (Awaited
    directly, a cancel could be lost: a client that connects inside ``asyncio.wait_for()``
    returns, on Python 3.11, the result of a connect that completed while its caller was being
    cancelled.) :meth:`cancel` -- the publisher's ``close()`` -- is what cancels the connect.
    """

    __slots__ = ("_broker", "_task")

    def __init__(self, broker: str) -> None:
        self._broker = broker
        self._task: asyncio.Task[T] | None = None

    async def wait(self, connect: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """The result of the connect in progress, or of ``connect()`` started now."""
        task = self._task
        if task is None or task.done():
            task = self._task = asyncio.create_task(connect())
            task.add_done_callback(self._done)
        await asyncio.wait({task})
        if task.cancelled():
            raise BrokerUnavailable(f"{self._broker}: the publisher was closed while it connected")
        error = task.exception()
        if isinstance(error, BrokerUnavailable):
            # One of its own for each batch: they are raised at once, in as many tasks.
            raise BrokerUnavailable(str(error)) from error.__cause__
        if error is not None:
            raise error
        return task.result()

    def cancel(self) -> None:
        """Cancel the connect in progress, if any; it keeps no connection (the publisher sees
        to that)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()

    def _done(self, task: asyncio.Task[T]) -> None:
        if self._task is task:
            self._task = None
        if not task.cancelled():
            # Said by the batches that waited for it, if any did.
            task.exception()
