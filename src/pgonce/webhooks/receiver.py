"""The receiving side of the webhook inbox: a plain ASGI app for ``POST /webhooks/{source}``.

For each delivery, in this order: find the source (404), read the body up to the source's limit
(413), verify the signature on the raw bytes (401), check the body is UTF-8 JSON when required
(400), name the event id, and store the delivery (:meth:`AsyncInboxStore.store`). A new event and
a duplicate with the same body are answered 200; the same event id with another body is answered
409 and logged as an integrity alert. Every refusal is an RFC 9457 problem that reveals no secret
and no payload; bad input never becomes a 500.

Guarantee: a 200 is sent only after the transaction holding the delivery has committed, so an
acknowledged event is never lost (that commit waits for its WAL to be flushed even where
``synchronous_commit`` is off). Concurrent deliveries share transactions (group commit): while
the first delivery's transaction is being committed, the ones that arrive meanwhile queue up and are
stored together by the next one, a single statement and a single commit for the whole batch.

The app is usable on its own (``uvicorn module:receiver``; it answers ASGI lifespan events) or
mounted inside any ASGI application (Starlette ``Mount("/webhooks", receiver)``); then open and
close it with ``async with receiver:`` or let it open its pool at the first request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, MutableMapping
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Literal

from psycopg import AsyncPipeline

from pgonce.config import DEFAULT_SCHEMA, own_connect_kwargs
from pgonce.core.checks import check_int, check_str, describe
from pgonce.core.inbox import (
    Delivery,
    Ordering,
    StoreOutcome,
    answer,
    describe_error,
    digest,
    parse_json,
    stored_headers,
    validate_event_id,
    validate_ordering,
)
from pgonce.core.throttle import Throttle, held_back
from pgonce.errors import (
    BadPayload,
    DatabaseUnavailable,
    EventConflict,
    PayloadTooLarge,
    PgonceError,
    SignatureInvalid,
    TimestampOutOfTolerance,
    UnknownSource,
    UsageError,
    WebhookError,
)
from pgonce.extras import needs
from pgonce.http.problem import send_problem
from pgonce.http.setup import middleware_pool
from pgonce.store._async.inbox import AsyncInboxStore
from pgonce.webhooks.schemes.common import aware
from pgonce.webhooks.source import Source, by_name

with needs("asgi", "the webhook receiver"):
    from psycopg_pool import AsyncConnectionPool

log = logging.getLogger("pgonce.inbox")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Any]
Send = Callable[[Message], Any]

#: What became of a request, as :meth:`InboxReceiver.respond` names it (the service's metrics
#: count it): ``unavailable`` is a 503 because the delivery could not be stored (the database),
#: ``swept`` a 503 because its event was being deleted by the sweeper as it came (retry later),
#: ``disconnected`` a sender that went away before its body was read (nobody is answered).
Outcome = Literal[
    "stored",
    "duplicate",
    "handshake",
    "conflict",
    "unavailable",
    "swept",
    "rejected_signature",
    "rejected_timestamp",
    "bad_payload",
    "too_large",
    "unknown_source",
    "bad_method",
    "disconnected",
]
_REFUSALS: tuple[tuple[type[WebhookError], Outcome], ...] = (
    (TimestampOutOfTolerance, "rejected_timestamp"),
    (SignatureInvalid, "rejected_signature"),
    (PayloadTooLarge, "too_large"),
    (UnknownSource, "unknown_source"),
    (EventConflict, "conflict"),
)

#: Deliveries stored by one statement at most. Beyond a few hundred a batch gains nothing (the
#: commit is already shared) and only makes the statement's parameters large.
DEFAULT_MAX_BATCH = 200

#: Transactions storing deliveries at the same time. Two keep the database busy while the next
#: batch gathers; more only split batches. It is also the size of a pool the receiver opens itself.
DEFAULT_FLUSHERS = 2

#: What a delivery that could not be stored (database down) is told: retry after this many seconds.
RETRY_AFTER_SECONDS = 5

#: How long a delivery waits for a connection of the receiver's own pool (``dsn=``): well within
#: a provider's own timeout (GitHub's is 10 s), so that a database that is down is answered 503
#: with Retry-After rather than cut by the provider after psycopg_pool's default 30 s. A pool the
#: caller hands in keeps its own timeout (the service's comes from ``[pool]``).
OWN_POOL_TIMEOUT = timedelta(seconds=5)

#: The longest a batch's statement waits for a lock (PostgreSQL's lock_timeout, local to its
#: transaction). A delivery waits for nothing but another transaction inserting the same event, a
#: batch that commits in milliseconds; a wait of seconds is a table lock held by someone else (a
#: LOCK TABLE, an ALTER TABLE, a VACUUM FULL). Without a bound, each delivery waited as long as
#: that lock lasted, holding a pool connection, until the pool was exhausted and every source
#: waited; bounded, it is answered 503 with Retry-After well within a provider's own timeout
#: (GitHub's is 10 s), and the provider's retry is stored once the lock is gone.
STORE_LOCK_TIMEOUT = timedelta(seconds=5)

#: Sent in the same pipeline as the transaction's BEGIN and the store: no round trip of its own.
#: It also makes the batch's COMMIT wait for its WAL to be flushed where the database or role
#: sets ``synchronous_commit = off``: that COMMIT returns before the commit record is written, and
#: a server crash then loses deliveries already answered 200, which their providers never send
#: again. Stronger settings (``remote_apply``, ``remote_write``, ``local``) are kept as they are.
_BOUND_LOCK_WAIT = (
    "SELECT set_config('lock_timeout', %s, true), "
    "CASE WHEN current_setting('synchronous_commit') = 'off' "
    "THEN set_config('synchronous_commit', 'on', true) END"
)
#: The durability part alone, for a libpq without pipeline mode.
_DURABLE_COMMIT = (
    "SELECT CASE WHEN current_setting('synchronous_commit') = 'off' "
    "THEN set_config('synchronous_commit', 'on', true) END"
)


def _utcnow() -> datetime:
    return datetime.now(UTC)


class InboxReceiver:
    """The ASGI app. Give it the sources and either a ``pool`` (owned by the caller) or a ``dsn``
    (the receiver opens and closes a small pool of its own).

    ``prefix`` is the path before ``/{source}``, relative to the mount point (``root_path``).
    ``max_batch`` and ``flushers`` tune group commit; ``max_batch=1`` stores each delivery in a
    transaction of its own. ``clock`` is the ``now`` given to the signature schemes.
    """

    def __init__(
        self,
        sources: Iterable[Source],
        *,
        pool: AsyncConnectionPool[Any] | None = None,
        dsn: str | None = None,
        schema: str = DEFAULT_SCHEMA,
        prefix: str = "/webhooks",
        max_batch: int = DEFAULT_MAX_BATCH,
        flushers: int = DEFAULT_FLUSHERS,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        if (pool is None) == (dsn is None):
            raise UsageError("give the receiver either a pool or a dsn")
        check_int(max_batch, "max_batch")
        check_int(flushers, "flushers")
        if dsn is not None:
            check_str(dsn, "the dsn")
        if pool is not None:
            # A sync pool (or anything without an async connection()) was taken, and every
            # delivery was then answered 503 "retry later", for ever, logged as a storage failure.
            pool = middleware_pool(pool, asynchronous=True)
        if not isinstance(prefix, str):
            raise UsageError(f"the prefix must be a str, not {describe(prefix)}")
        if prefix and not prefix.startswith("/"):
            # A request's path starts with "/": without one, every delivery was answered 404.
            raise UsageError(f"the prefix must start with '/', as {'/' + prefix!r} does")
        # Read once here: a naive or non-datetime clock would fail every signed timestamp's check
        # (answered 401, authentic or not) from the first delivery on.
        sample = clock() if callable(clock) else None
        if not isinstance(sample, datetime):
            raise UsageError(f"the clock must return a datetime, not {describe(sample)}")
        aware(sample)
        self.sources = by_name(sources)
        # A name pgonce's schema cannot have was taken, and every delivery was then answered
        # 503 "retry later" for ever (the schema not migrated, which `pgonce migrate` refuses).
        self.store = AsyncInboxStore(schema=schema)
        self.prefix = prefix.rstrip("/")
        self.clock = clock
        self._owns_pool = pool is None
        self.pool: AsyncConnectionPool[Any] = pool or AsyncConnectionPool(
            dsn or "",
            min_size=1,
            max_size=flushers,
            kwargs=own_connect_kwargs(),
            open=False,
            name="pgonce-inbox-receiver",
            timeout=OWN_POOL_TIMEOUT.total_seconds(),
        )
        self._max_batch = max_batch
        self._max_flushers = flushers
        self._queue: list[tuple[Delivery, asyncio.Future[StoreOutcome]]] = []
        self._flushers = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        self._opening: asyncio.Future[None] | None = None
        self._fallback_warned: set[str] = set()  # sources whose event_id_fallback broke
        # The failures of a source's code (its scheme, its extractors) and the deliveries that
        # could not be stored: one report a minute per source, step and cause (with the
        # traceback the first time only, for the source's code).
        self._reports = Throttle()
        self._traced: set[tuple[str, str, str]] = set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the receiver's own pool (a caller's pool is the caller's to open).

        Concurrent callers (the first requests, when nobody started the receiver) all wait for
        the one opening, so none of them meets a pool that is not open yet.
        """
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        opening = self._opening
        try:
            await asyncio.shield(opening)
        except Exception as error:
            if opening is self._opening:
                self._opening = None  # the next request tries again
            if isinstance(error, PgonceError):
                raise
            raise DatabaseUnavailable(f"the inbox receiver could not connect: {error}") from error

    async def _open(self) -> None:
        if self._owns_pool:
            await self.pool.open(wait=True, timeout=self.pool.timeout)
        self._started = True

    async def close(self) -> None:
        """Wait until every queued delivery was stored and answered, then close the own pool."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._owns_pool and not self.pool.closed:
            await self.pool.close()
        self._started = False
        self._opening = None

    async def __aenter__(self) -> InboxReceiver:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- ASGI ----------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] == "http":
            await self.respond(scope, receive, send)

    async def respond(self, scope: Scope, receive: Receive, send: Send) -> Outcome:
        """Answer one HTTP request and name what became of it."""
        try:
            return await self._handle(scope, receive, send)
        except WebhookError as error:
            await send_problem(send, error.status, error.title, str(error))
            # A scheme's own WebhookError is named by its status, as the sender sees it.
            return next(
                (outcome for kind, outcome in _REFUSALS if isinstance(error, kind)),
                "rejected_signature" if error.status == 401 else "bad_payload",
            )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except PgonceError as error:
                    await send({"type": "lifespan.startup.failed", "message": str(error)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _source_of(self, scope: Scope) -> Source:
        path: str = scope.get("path", "")
        root: str = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        if not path.startswith(self.prefix + "/"):
            raise UnknownSource()
        name = path[len(self.prefix) + 1 :]
        source = self.sources.get(name)
        if source is None:
            raise UnknownSource()
        return source

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> Outcome:
        source = self._source_of(scope)
        if scope.get("method") != "POST":
            await send_problem(send, 405, headers=[("allow", "POST")])
            return "bad_method"
        headers = _headers(scope)
        body = await _read_body(receive, headers, source.body_limit)
        if body is None:
            return "disconnected"  # the client went away; nobody is left to answer
        self._verify(source, headers, body)
        handshake: Callable[[bytes], bytes | None] | None = getattr(
            source.scheme, "handshake", None
        )  # Handshaking's, found by name: an isinstance() of a Protocol costs each delivery
        if (
            handshake is not None
            and (reply := self._handshake(source, handshake, body)) is not None
        ):
            # Before the event's id and ordering are read: a handshake is no event, and the
            # application's extractors, written for events, may well fail on it.
            await _send_json(send, 200, reply)
            return "handshake"
        delivery = self._delivery(source, headers, body)
        try:
            outcome = await self._submit(delivery)
        except PgonceError as error:
            self._not_stored(source, error)
            await send_problem(
                send,
                503,
                detail="the delivery could not be stored; retry later",
                headers=[("retry-after", str(RETRY_AFTER_SECONDS))],
            )
            return "unavailable"
        if outcome == "conflict":
            # A provider bug or a spoofed replay with a valid signature: never a silent 200.
            log.warning(
                "integrity alert: source %s event %s was received again with a different body",
                source.name,
                delivery.event_id,
                extra={"source": source.name, "event_id": delivery.event_id},
            )
            raise EventConflict()
        if outcome == "gone":
            await send_problem(
                send,
                503,
                detail="the event is being cleaned up; retry later",
                headers=[("retry-after", "1")],
            )
            return "swept"
        await _send_ok(send, answer(outcome), outcome)
        return outcome

    def _verify(self, source: Source, headers: dict[str, str], body: bytes) -> None:
        try:
            source.scheme.verify(headers, body, now=self.clock())
        except WebhookError:
            raise
        except Exception as error:
            # A scheme must raise only WebhookErrors; a bug in one fails closed, never a 500.
            self._code_failed(source, f"scheme {source.scheme.name}", error, 401)
            raise SignatureInvalid() from None

    def _handshake(
        self, source: Source, handshake: Callable[[bytes], bytes | None], body: bytes
    ) -> bytes | None:
        try:
            reply = handshake(body)
            if reply is not None and not isinstance(reply, bytes):
                raise TypeError(f"a handshake answers bytes or None, not {describe(reply)}")
        except WebhookError:
            raise
        except Exception as error:
            # A scheme's handshake reads an authentic but unexpected body; its failure is no 500.
            self._code_failed(source, f"handshake of scheme {source.scheme.name}", error, 400)
            raise BadPayload("the delivery could not be read as a handshake") from None
        return reply

    def _delivery(self, source: Source, headers: dict[str, str], body: bytes) -> Delivery:
        """The verified delivery as the inbox stores it: its event id, headers and ordering."""
        payload = parse_json(body) if source.json_required else None
        step = f"event id extraction of scheme {source.scheme.name}"
        try:
            event_id = source.scheme.event_id(headers, body)
            if event_id is None:
                step = "event_id_fallback"
                event_id = source.event_id_fallback(headers, body)
                if not isinstance(event_id, str):
                    self._fallback_not_text(source, event_id)
        except WebhookError:
            raise
        except Exception as error:
            # The scheme's or the application's extractor broke on an authentic delivery.
            self._code_failed(source, step, error, 400)
            raise BadPayload("the event id could not be read") from None
        ordering = self._ordering(source, payload, headers)
        return Delivery(
            source=source.name,
            event_id=validate_event_id(event_id),
            body=body,
            headers=stored_headers(headers, getattr(source.scheme, "header_names", None)),
            digest=digest(body),
            ordering=ordering,
        )

    def _ordering(self, source: Source, payload: Any, headers: dict[str, str]) -> Ordering | None:
        if source.ordering is None:
            return None
        try:
            ordering = source.ordering(payload, headers)
        except Exception as error:
            # The extractor is application code reading an untrusted payload; its failure is the
            # payload's fault as far as the provider is concerned, and must not be a 500.
            self._code_failed(source, "ordering extractor", error, 400, logging.WARNING)
            raise BadPayload("the ordering key could not be read") from None
        if ordering is None:
            return None
        if not isinstance(ordering, Ordering):
            raise BadPayload("the ordering key could not be read")
        return validate_ordering(ordering)

    def _code_failed(
        self, source: Source, what: str, error: Exception, status: int, level: int = logging.ERROR
    ) -> None:
        """Report that ``what`` (a scheme's or the application's code) raised ``error`` on a
        delivery to ``source``, answered ``status``: once a minute per source, step and cause,
        counting the ones held back, with the traceback the first time. A provider retries
        every refused delivery, and a traceback per retry buried everything else in the log."""
        kind = (source.name, what, type(error).__qualname__)
        held = self._reports.admit(kind, _utcnow())
        if held is None:
            return
        first = kind not in self._traced
        if first and len(self._traced) < 1000:
            self._traced.add(kind)
        log.log(
            level,
            "the %s of source %s raised %s: its deliveries are answered %d, which the provider "
            "retries, until it is fixed (reported once a minute per source and cause, the "
            "traceback the first time)%s",
            what,
            source.name,
            describe_error(error),
            status,
            held_back(held),
            exc_info=error if first else None,
            extra={"source": source.name},
        )

    def _not_stored(self, source: Source, error: PgonceError) -> None:
        """Report that a delivery to ``source`` could not be stored (answered 503 with
        Retry-After): once a minute per source and cause, counting the ones held back. An
        overloaded pool refuses every delivery beyond it, and a line per refusal flooded the
        log under exactly the load where it matters; the metrics count every answer."""
        cause = type(error.__cause__ or error).__qualname__
        held = self._reports.admit((source.name, "store", cause), _utcnow())
        if held is None:
            return
        log.warning(
            "storing a delivery of %s failed: %s; it is answered 503 with Retry-After %d s, "
            "which the provider retries (reported once a minute per source and cause)%s",
            source.name,
            error,
            RETRY_AFTER_SECONDS,
            held_back(held),
            extra={"source": source.name},
        )

    def _fallback_not_text(self, source: Source, event_id: object) -> None:
        """The application's ``event_id_fallback`` broke its contract: the provider is answered
        400 (by :func:`validate_event_id`), which it retries; the team hears of it once per
        source, not at every retry."""
        if source.name in self._fallback_warned:
            return
        self._fallback_warned.add(source.name)
        log.error(
            "the event_id_fallback of source %s returned %s, not a str: its deliveries without "
            "an id are answered 400 and retried by the provider until the function is fixed "
            "(logged once)",
            source.name,
            describe(event_id),
            extra={"source": source.name},
        )

    # -- group commit --------------------------------------------------------------------------

    async def _submit(self, delivery: Delivery) -> StoreOutcome:
        """Queue ``delivery``; resolve once the transaction that stored it has committed."""
        if not self._started:
            await self.start()
        future: asyncio.Future[StoreOutcome] = asyncio.get_running_loop().create_future()
        self._queue.append((delivery, future))
        if self._flushers < self._max_flushers:
            self._flushers += 1
            # A task of its own, not the request's: a client that hangs up must not cancel the
            # storing of other clients' deliveries that ride in the same batch.
            task = asyncio.create_task(self._flush())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await future

    async def _flush(self) -> None:
        try:
            while self._queue:
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
                await self._store_batch(batch)
        finally:
            # No await between the queue check above and this line: a delivery queued meanwhile
            # would have found this flusher still counted and is picked up by the loop.
            self._flushers -= 1

    async def _store_batch(
        self, batch: list[tuple[Delivery, asyncio.Future[StoreOutcome]]]
    ) -> None:
        try:
            async with self.pool.connection() as conn:
                if not AsyncPipeline.is_supported():
                    # A libpq before 14 has no pipeline (conn.pipeline() raises): the bound
                    # would cost a round trip of its own, so it goes without; the durable
                    # commit does not (a 200 promises the delivery is kept), a round trip there.
                    async with conn.transaction():
                        await conn.execute(_DURABLE_COMMIT)
                        outcomes = await self.store.store(conn, [d for d, _ in batch])
                else:
                    async with conn.pipeline(), conn.transaction():
                        bound = f"{int(STORE_LOCK_TIMEOUT.total_seconds() * 1000)}ms"
                        await conn.execute(_BOUND_LOCK_WAIT, (bound,))
                        outcomes = await self.store.store(conn, [d for d, _ in batch])
        except DatabaseUnavailable as error:
            _settle(batch, error=error)
        except PgonceError as error:
            if len(batch) == 1:
                _settle(batch, error=error)
                return
            # One delivery the database refuses must not fail the others it shares a batch with:
            # store each alone, so only that one is answered 503.
            log.warning(
                "a batch of %d deliveries failed (%s); storing one by one", len(batch), error
            )
            for item in batch:
                await self._store_batch([item])
        except Exception as error:  # the pool's timeouts and lost connections
            unavailable = DatabaseUnavailable(f"the inbox could not store: {error}")
            unavailable.__cause__ = error  # the cause its report is held back by
            _settle(batch, error=unavailable)
        else:
            _settle(batch, outcomes=outcomes)


def _settle(
    batch: list[tuple[Delivery, asyncio.Future[StoreOutcome]]],
    *,
    outcomes: list[StoreOutcome] | None = None,
    error: PgonceError | None = None,
) -> None:
    for i, (_, future) in enumerate(batch):
        if future.done():  # the request was cancelled meanwhile
            continue
        if outcomes is not None:
            future.set_result(outcomes[i])
        else:
            future.set_exception(error or PgonceError())


def _headers(scope: Scope) -> dict[str, str]:
    """Lower-case names; repeated headers joined with ", " (RFC 9110), as schemes expect, and a
    value repeated as it is taken once: a proxy that doubles a provider's id header would
    otherwise make ``gh_1, gh_1`` a new event id, and the delivery a second event."""
    found: dict[str, str] = {}
    for raw_name, raw_value in scope.get("headers", ()):
        name = bytes(raw_name).decode("latin-1").lower()
        value = bytes(raw_value).decode("latin-1")
        if name not in found:
            found[name] = value
        elif value not in found[name].split(", "):
            found[name] = f"{found[name]}, {value}"
    return found


async def _read_body(receive: Receive, headers: dict[str, str], limit: int) -> bytes | None:
    """The whole body, read chunk by chunk and abandoned as soon as it exceeds ``limit``."""
    declared = headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge()
    chunks = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks += message.get("body", b"")
        if len(chunks) > limit:
            raise PayloadTooLarge()
        if not message.get("more_body", False):
            return bytes(chunks)


async def _send_ok(send: Send, status: int, outcome: StoreOutcome) -> None:
    await _send_json(send, status, b'{"outcome":"%s"}' % outcome.encode())


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
