"""Idempotency-Key for HTTP APIs: a pure ASGI middleware on the key store.

For a request that needs idempotency (POST and PATCH by default, per route configurable) the
middleware reads the request body, takes a connection from the application's pool, opens a
transaction and claims ``(scope, key)`` in it. On a won claim it runs the application with that
transaction available to the endpoint (:mod:`pgonce.http.transaction`), buffers the response,
stores it and commits — the claim, the endpoint's writes and the stored response commit in ONE
transaction — and only then sends the response. So a client never sees a success that did not
commit, and a crash at any point leaves either everything or nothing.

Guarantees and answers:

- **replay**: the same status, the byte-identical body and the application's headers (never
  ``Set-Cookie``, hop-by-hop, ``Content-Length`` or ``Date``; see :mod:`pgonce.http.replay`),
  marked ``Idempotent-Replayed: true``.
- **in flight**: 409 with ``Retry-After``; nothing is consumed. With ``wait`` set, a duplicate first
  waits (bounded) for the original's transaction, then replays (or runs, if the original rolled
  back).
- **mismatch** (same key, another method, path, query or body): 422.
- **missing or malformed key**: 400. **Request body over** ``max_request_bytes``: 413.
- **not stored** (the transaction rolls back, the endpoint's writes with it, and the key stays
  free): the application raised; it answered 5xx (unless the key store keeps server errors); the
  endpoint never began, i.e. never took the connection (framework validation and authentication
  failures); the response body exceeded ``max_response_bytes`` (then the client gets a 500
  problem instead: a response that cannot be replayed must not be given out as if it could).
- **streaming responses** are buffered in full (up to ``max_response_bytes``), stored, and sent
  after the commit as one body.
- Every answer for a stored key carries ``Idempotency-Key-Expires`` (an HTTP-date: claim time plus
  ``retention``): until then a retry gets the stored response. Keep the sweeper's horizon at least
  this long.

Errors are RFC 9457 problem responses that never echo another caller's data. The middleware keeps
no per-request state on the instance: everything per request lives in locals and in the scope.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import psycopg
from psycopg import AsyncConnection

from pgonce.config import DEFAULT_SCHEMA
from pgonce.core.outcomes import InFlight, Replay, Response, Won
from pgonce.core.requests import request_fingerprint
from pgonce.errors import DatabaseUnavailable, InvalidIdempotencyKey, KeyMismatch, UsageError
from pgonce.extras import needs
from pgonce.http.keys import HEADER as KEY_HEADER
from pgonce.http.keys import key_of
from pgonce.http.problem import send_problem
from pgonce.http.replay import EXPIRES_HEADER, replay_headers, storable_headers
from pgonce.http.transaction import STATE_KEY, IdempotentTransaction
from pgonce.store._async.keys import AsyncKeyStore, rollback_quietly

with needs("asgi", "the Idempotency-Key middleware"):
    from psycopg_pool import AsyncConnectionPool, PoolTimeout

log = logging.getLogger("pgonce.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Names the key store scope of a request (the caller: principal, API key, tenant), or ``None`` to
#: leave the request alone (e.g. no credentials: the application will refuse it itself).
KeyScope = Callable[[Scope], "str | Awaitable[str | None] | None"]

#: The methods that need idempotency unless a route says otherwise. GET, HEAD, OPTIONS, PUT and
#: DELETE are idempotent by definition (RFC 9110); POST and PATCH are not.
DEFAULT_METHODS = frozenset({"POST", "PATCH"})

#: Largest request body read for fingerprinting, in bytes. Payment and order APIs send a few
#: kilobytes; one MiB leaves room without letting one request hold a megabyte buffer per retry.
DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024

#: Largest response body stored for replay, in bytes (the same reasoning as for requests).
DEFAULT_MAX_RESPONSE_BYTES = 1024 * 1024

#: How long a key is advertised as honoured (``Idempotency-Key-Expires``). Stripe keeps keys for
#: 24 hours, and clients' retry policies are built around that figure. The sweeper's horizon must
#: be at least this long, or the header would promise more than the store keeps.
DEFAULT_RETENTION = timedelta(hours=24)

#: What "do not wait" (``wait=None``) means for the claim's lock wait. Not one millisecond: the
#: claim's INSERT also waits on PostgreSQL's own short locks (a table extended by concurrent
#: inserts), and a timeout there would answer 409 to a brand-new key. 100 ms rides those out and
#: is still far shorter than any endpoint a duplicate could be waiting for.
NO_WAIT = timedelta(milliseconds=100)

# Extensions that would let the app bypass the buffered body (a file sent by path, zero-copy).
_BYPASSING_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopysend")


def header_scope(name: str, *, prefix: str = "") -> KeyScope:
    """A key scope from a request header (an API key, a tenant id); ``None`` when it is absent.

    The value is stored as its SHA-256, so that a credential never lands in the key store.
    """
    wanted = name.lower().encode("latin-1")

    def scope_of(scope: Scope) -> str | None:
        for header, value in scope["headers"]:
            if header == wanted and value:
                return prefix + hashlib.sha256(value).hexdigest()
        return None

    return scope_of


#: Failures that mean "the database went away", not "the code is wrong": a lost or refused
#: connection (OperationalError covers AdminShutdown and a statement cancelled by a timeout), the
#: pool's timeout, and pgonce's translation of them.
_UNAVAILABLE = (PoolTimeout, DatabaseUnavailable, psycopg.OperationalError)


def _log_unavailable(claim: Won, error: BaseException) -> None:
    # One line, no traceback: an outage is an event to count, not a bug to debug.
    log.warning(
        "idempotent request rolled back, the database went away: %s: %s",
        type(error).__name__,
        str(error).strip().splitlines()[0] if str(error).strip() else "",
        extra={"scope": claim.scope, "outcome": "unavailable"},
    )


@dataclass(slots=True)
class _Captured:
    """The application's response, held back until the transaction has committed."""

    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    size: int = 0
    complete: bool = False
    too_large: bool = False
    #: Decided after the application returned: the response is kept for replays.
    stored: bool = False
    #: The database went away while the endpoint ran or while its work was committed: nothing
    #: committed (or, if COMMIT's answer was lost, the retry replays what did), so the client is
    #: told to retry: 503 with Retry-After, never a 500 and a traceback.
    unavailable: bool = False

    @property
    def answered(self) -> bool:
        """A complete response, within the size limit, that can be sent (and stored)."""
        return self.status is not None and self.complete and not self.too_large

    def response(self) -> Response:
        return Response(self.status, storable_headers(self.headers), b"".join(self.body))


class IdempotencyMiddleware:
    """Pure ASGI middleware that makes POST and PATCH safe to retry with an Idempotency-Key.

    ``pool`` is the application's :class:`~psycopg_pool.AsyncConnectionPool` (opened by the
    application, e.g. in its lifespan); ``key_scope`` is required: it names whose key a request
    carries, so that the same key from two callers never meets (:func:`header_scope` makes one
    from a header). ``routes`` maps path prefixes to the methods that need idempotency there (the
    longest prefix wins; an empty collection turns a route off); other paths use ``methods``.
    ``require_key`` answers 400 to such a request without a key (else it passes, unprotected).
    ``wait`` lets a duplicate wait that long for the original, then replay; ``None`` answers 409
    at once (see :data:`NO_WAIT`). ``store`` defaults to an :class:`AsyncKeyStore` on
    ``schema`` with that wait; its ``store_server_errors`` decides whether 5xx responses are kept.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        pool: AsyncConnectionPool[Any],
        key_scope: KeyScope,
        store: AsyncKeyStore | None = None,
        schema: str = DEFAULT_SCHEMA,
        methods: Collection[str] = DEFAULT_METHODS,
        routes: Mapping[str, Collection[str]] | None = None,
        require_key: bool = True,
        wait: timedelta | None = None,
        canonicalize_json: bool = True,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        retention: timedelta = DEFAULT_RETENTION,
    ) -> None:
        if not callable(key_scope):
            raise UsageError("key_scope must be a function of the ASGI scope")
        self.app = app
        self.pool = pool
        self.key_scope = key_scope
        self.methods = frozenset(m.upper() for m in methods)
        # Longest prefix first, so that the most specific route decides.
        self.routes = sorted(
            (
                (prefix.rstrip("/"), frozenset(m.upper() for m in ms))
                for prefix, ms in (routes or {}).items()
            ),
            key=lambda item: len(item[0]),
            reverse=True,
        )
        self.require_key = require_key
        self.wait = wait if wait is not None else NO_WAIT
        self.store = store or AsyncKeyStore(schema=schema, wait=self.wait)
        # None: the store's own wait, which it checked once, not at every claim.
        self._claim_wait = None if self.wait == self.store.wait else self.wait
        self.canonicalize_json = canonicalize_json
        self.max_request_bytes = max_request_bytes
        self.max_response_bytes = max_response_bytes
        self.retention = retention
        self._retention_seconds = retention.total_seconds()

    def methods_for(self, path: str) -> frozenset[str]:
        """The methods that need idempotency on ``path``."""
        if not self.routes:
            return self.methods
        for prefix, methods in self.routes:
            if path == prefix or path.startswith(prefix + "/") or not prefix:
                return methods
        return self.methods

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.methods_for(scope["path"]):
            await self.app(scope, receive, send)
            return
        keys, content_type, content_length = _request_headers(scope["headers"])
        try:
            key = key_of(keys)
        except InvalidIdempotencyKey as error:
            await send_problem(send, error.status, error.title, str(error))
            return
        if key is None:
            if self.require_key:
                await send_problem(
                    send,
                    400,
                    "Idempotency-Key required",
                    "this request must carry an Idempotency-Key header",
                )
            else:
                await self.app(scope, receive, send)
            return
        caller = self.key_scope(scope)
        if caller is not None and not isinstance(caller, str):
            caller = await caller  # an async key scope
        if caller is None:
            await self.app(scope, receive, send)
            return
        body = await self._read_body(receive, send, content_length)
        if body is None:
            return
        fingerprint = request_fingerprint(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            body,
            content_type=content_type,
            canonicalize_json=self.canonicalize_json,
        )
        await self._handle(scope, receive, send, caller, key, fingerprint, body)

    async def _read_body(
        self, receive: Receive, send: Send, declared: bytes | None
    ) -> bytes | None:
        """The whole request body; ``None`` once a 413 was sent or the client went away."""
        if declared and declared.isdigit() and int(declared) > self.max_request_bytes:
            await self._too_large(send)
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_bytes:
                await self._too_large(send)
                return None
            if not message.get("more_body", False):
                # Most bodies arrive in one message: no copy then.
                return b"".join((*chunks, chunk)) if chunks else chunk
            chunks.append(chunk)

    async def _too_large(self, send: Send) -> None:
        await send_problem(
            send,
            413,
            "Request body too large",
            f"idempotent requests may carry at most {self.max_request_bytes} bytes",
        )

    async def _handle(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        caller: str,
        key: str,
        fingerprint: bytes,
        body: bytes,
    ) -> None:
        captured: _Captured | None = None
        try:
            async with self.pool.connection() as conn:
                # BEGIN and the claim in one round trip; a claim that did not win has ended
                # the transaction. The endpoint then runs on this connection through psycopg
                # as usual, not in pipeline mode (which would refuse its COPY and server-side
                # cursors and report its errors late): only pgonce's statements are batched.
                claim = await self.store.begin(
                    conn, caller, key, fingerprint, wait=self._claim_wait
                )
                if isinstance(claim, Won):
                    try:
                        captured = await self._run(scope, receive, send, conn, claim, body)
                        if captured.stored:
                            # The completion and COMMIT in one round trip. A failed completion
                            # (e.g. the endpoint left the transaction aborted) raises, and the
                            # transaction is rolled back.
                            await self.store.commit(conn, claim, captured.response())
                        else:
                            await conn.rollback()
                    except _UNAVAILABLE as error:
                        await rollback_quietly(conn)
                        if captured is None:
                            raise
                        captured.unavailable = True
                        _log_unavailable(claim, error)
                    except BaseException:
                        await rollback_quietly(conn)
                        raise
        except KeyMismatch:
            await send_problem(
                send,
                422,
                "Idempotency-Key reused",
                "this Idempotency-Key was first used with a different request (method, path, "
                "query or body); retry only with the identical request, or use a new key",
            )
            return
        except _UNAVAILABLE:
            # Before the endpoint began: the claim (or the pool) could not reach the database.
            await self._unavailable(send)
            return
        # Everything below runs after the commit (or the rollback): the client never sees an
        # answer that did not commit.
        if captured is not None and captured.unavailable:
            await self._unavailable(send)
        elif captured is not None:
            await self._answer(send, captured, claim)
        elif isinstance(claim, Replay):
            response = claim.response
            expires = (EXPIRES_HEADER, self._expires(claim.claimed_at))
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status or 200,
                    "headers": replay_headers(response, [expires]),
                }
            )
            await send({"type": "http.response.body", "body": response.body})
        else:
            assert isinstance(claim, InFlight)
            await send_problem(
                send,
                409,
                "Request in progress",
                "a request with this Idempotency-Key is still being processed; "
                "retry after the time in Retry-After",
                headers=[("retry-after", str(claim.retry_after))],
            )

    async def _unavailable(self, send: Send) -> None:
        await send_problem(
            send,
            503,
            "Service temporarily unavailable",
            "the database could not be reached and nothing was committed; retry with the same "
            "Idempotency-Key",
            headers=[("retry-after", str(self.store.retry_after))],
        )

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        conn: AsyncConnection[Any],
        claim: Won,
        body: bytes,
    ) -> _Captured:
        """Run the application in the claim's transaction and capture its response.

        An exception from the application propagates (the transaction rolls back); if the
        application answered before raising (Starlette's error handler does), that answer is
        forwarded first.
        """
        tx = IdempotentTransaction(conn, claim.scope, claim.key)
        captured = _Captured()
        app_scope = dict(scope)
        app_scope["state"] = {**(scope.get("state") or {}), STATE_KEY: tx}
        extensions = scope.get("extensions")
        if extensions and any(name in extensions for name in _BYPASSING_EXTENSIONS):
            app_scope["extensions"] = {
                k: v for k, v in extensions.items() if k not in _BYPASSING_EXTENSIONS
            }
        body_sent = False

        async def replay_body() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                captured.status = int(message["status"])
                captured.headers = list(message.get("headers", ()))
            elif message["type"] == "http.response.body" and not captured.complete:
                chunk = message.get("body", b"")
                captured.size += len(chunk)
                if captured.size > self.max_response_bytes:
                    captured.too_large = True
                    captured.body.clear()
                elif chunk:
                    captured.body.append(chunk)
                captured.complete = not message.get("more_body", False)

        try:
            await self.app(app_scope, replay_body, capture)
        except _UNAVAILABLE as error:
            if captured.answered:
                await _forward(send, captured, [])
                raise
            # The endpoint's own statements lost the database: its transaction is gone.
            captured.unavailable = True
            _log_unavailable(claim, error)
            return captured
        except BaseException:
            if captured.answered:
                await _forward(send, captured, [])
            raise
        # Stored only when the endpoint began (it took the connection: framework validation and
        # authentication failures never do), answered completely within the size limit, and the
        # key store keeps the status (a 5xx is not kept unless configured).
        captured.stored = (
            tx.began and captured.answered and self.store.stores_status(captured.status)
        )
        return captured

    async def _answer(
        self, send: Send, captured: _Captured, claim: Won | Replay | InFlight
    ) -> None:
        """Send the application's own answer, after its transaction committed or rolled back."""
        if not captured.answered:
            if captured.too_large:
                await send_problem(
                    send,
                    500,
                    "Response too large to store",
                    "the response exceeded the size that can be stored for replay; "
                    "nothing was done",
                )
            # Otherwise the application never answered: the server reports that as a 500.
            return
        extra: list[tuple[bytes, bytes]] = []
        if captured.stored and isinstance(claim, Won):
            extra.append((_EXPIRES, self._expires(claim.claimed_at).encode()))
        await _forward(send, captured, extra)

    def _expires(self, claimed_at: datetime) -> str:
        return _http_date(int(claimed_at.timestamp() + self._retention_seconds))


_EXPIRES = EXPIRES_HEADER.encode()


@functools.lru_cache(maxsize=16)
def _http_date(epoch_seconds: int) -> str:
    # An HTTP-date has whole seconds, so every request of one second shares the formatted value.
    return format_datetime(datetime.fromtimestamp(epoch_seconds, UTC), usegmt=True)


def _request_headers(
    headers: Iterable[tuple[bytes, bytes]],
) -> tuple[list[bytes], str | None, bytes | None]:
    """One pass over the request headers: Idempotency-Key values, Content-Type, Content-Length.

    Of a header sent twice, the first counts (Content-Type and Content-Length; the key may not
    be sent twice at all).
    """
    keys: list[bytes] = []
    content_type: str | None = None
    content_length: bytes | None = None
    for name, value in headers:
        name = name.lower()
        if name == KEY_HEADER:
            keys.append(value)
        elif name == b"content-type" and content_type is None:
            content_type = value.decode("latin-1")
        elif name == b"content-length" and content_length is None:
            content_length = value
    return keys, content_type, content_length


async def _forward(send: Send, captured: _Captured, extra: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": captured.status,
            "headers": [*captured.headers, *extra],
        }
    )
    await send({"type": "http.response.body", "body": b"".join(captured.body)})
