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
  back); on a two-phase route it looks at the key again until the holder stored its answer, up to
  the same ``wait`` (:class:`~pgonce.http.semantics.HolderWait`).
- **mismatch** (same key, another method, path, query or body): 422.
- **missing or malformed key**: 400. **Request body over** ``max_request_bytes``: 413.
- **not stored** (the transaction rolls back, the endpoint's writes with it, and the key stays
  free): the application raised; it answered 5xx (unless the key store keeps server errors) or
  429 (a rate limit refused it: the retry after ``Retry-After`` runs); the endpoint never
  began, i.e. never took the connection (framework validation and authentication failures); the
  response body exceeded ``max_response_bytes`` (then the client gets a 500
  problem instead: a response that cannot be replayed must not be given out as if it could; on
  a two-phase route it says that the phases that committed were kept, and a retry with the same
  key resumes after them).
- **an endpoint that ends the request's transaction itself** (a commit or rollback on its
  connection) and runs nothing after leaves no key in flight: after a commit its answer is stored
  just after; after a rollback nothing committed, and the client gets the 500 problem
  :data:`~pgonce.http.semantics.TRANSACTION_ENDED`. One that runs statements after the end gets
  a 500 problem either way, its answer neither sent nor stored (it may name rows that were rolled
  back): after a rollback :data:`~pgonce.http.semantics.TRANSACTION_ENDED`, after a commit
  :data:`~pgonce.http.semantics.TRANSACTION_ENDED_COMMITTED` (the writes before it committed
  with the claim, which stays in flight). Either way the log names the error.
- **streaming responses** are buffered in full (up to ``max_response_bytes``), stored, and sent
  after the commit as one body.
- Every answer for a stored key carries ``Idempotency-Key-Expires`` (an HTTP-date: claim time plus
  ``retention``): until then a retry gets the stored response. Keep the sweeper's horizon at least
  this long.

Errors are RFC 9457 problem responses that never echo another caller's data. The middleware keeps
no per-request state on the instance: everything per request lives in locals and in the scope.

Every decision above (which requests, the key, the fingerprint, the limits, what is stored, each
answer) is made by :mod:`pgonce.http.semantics`, which every framework adapter shares; this module
translates ASGI messages and the pool's transaction onto it.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import time
import warnings
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, MutableMapping
from contextlib import AbstractAsyncContextManager
from datetime import timedelta
from typing import Any, Protocol

import psycopg
from psycopg import AsyncConnection

from pgonce.core.leases import failure_note, not_stored_note
from pgonce.core.outcomes import TOO_MANY_REQUESTS, InFlight, Replay, Won
from pgonce.core.requests import request_fingerprint
from pgonce.errors import (
    DatabaseUnavailable,
    InvalidIdempotencyKey,
    KeyMismatch,
    LeaseLost,
    MissingKeyScope,
    UsageError,
)
from pgonce.extras import needs
from pgonce.http import semantics
from pgonce.http.keys import HEADER as KEY_HEADER
from pgonce.http.keys import key_of
from pgonce.http.semantics import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_METHODS,
    DEFAULT_RETENTION,
    NO_WAIT,
    Answer,
    CapturedResponse,
    HolderWait,
    IdempotencyRules,
    PhasedRequest,
)
from pgonce.http.semantics import IDLE as _IDLE
from pgonce.http.setup import SCHEMA_NOT_GIVEN, middleware_pool, middleware_stores
from pgonce.http.transaction import PHASED_KEY, STATE_KEY, IdempotentTransaction
from pgonce.store._async.keys import AsyncKeyStore, EndedThenWrote, rollback_quietly
from pgonce.store._async.phases import AsyncPhasedOperation, AsyncPhaseStore

with needs("asgi", "the Idempotency-Key middleware"):
    from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Names the key store scope of a request (the caller: principal, API key, tenant), or ``None`` to
#: leave the request alone (e.g. no credentials: the application will refuse it itself).
KeyScope = Callable[[Scope], "str | Awaitable[str | None] | None"]


class ConnectionSource(Protocol):
    """Where the middleware takes a connection for a request: an ``AsyncConnectionPool``, or
    anything with the same ``connection()`` (e.g. ``pgonce.contrib.sqlalchemy.EngineConnections``,
    a SQLAlchemy engine's pool). The connection must come idle; the middleware owns the
    transaction it opens on it and ends it before giving the connection back."""

    def connection(self) -> AbstractAsyncContextManager[AsyncConnection[Any]]: ...


__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_METHODS",
    "DEFAULT_RETENTION",
    "NO_WAIT",
    "ConnectionSource",
    "IdempotencyMiddleware",
    "header_scope",
]

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


class IdempotencyMiddleware:
    """Pure ASGI middleware that makes POST and PATCH safe to retry with an Idempotency-Key.

    ``pool`` is the application's :class:`~psycopg_pool.AsyncConnectionPool` (opened by the
    application, e.g. in its lifespan), or another :class:`ConnectionSource`; ``key_scope`` is
    required: it names whose key a request carries, so that the same key from two callers never
    meets (:func:`header_scope` makes one from a header). ``routes`` maps path prefixes to the
    methods that need idempotency there (the longest prefix wins; an empty collection turns a
    route off); other paths use ``methods``. The prefixes of ``routes`` and ``two_phase`` name
    paths inside the application, without the ``root_path`` it is mounted under.
    ``require_key`` answers 400 to such a request without a key (else it passes, unprotected).
    ``wait`` lets a duplicate wait that long for the original, then replay; ``None`` answers 409
    at once (see :data:`NO_WAIT`). ``store`` defaults to an :class:`AsyncKeyStore` on
    ``schema`` with that wait; its ``store_server_errors`` decides whether 5xx responses are kept.

    ``two_phase`` lists path prefixes served in two-phase mode, for endpoints that call a third
    party and answer with its result (:mod:`pgonce.phases`): the claim commits at once with a
    lease, the endpoint runs its phases on :func:`pgonce.http.phased`, and its response is
    stored with the holder's fencing token. ``phases`` defaults to an
    :class:`~pgonce.phases.AsyncPhaseStore` on ``schema`` with the key store's settings.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        pool: AsyncConnectionPool[Any] | ConnectionSource,
        key_scope: KeyScope,
        store: AsyncKeyStore | None = None,
        schema: str = SCHEMA_NOT_GIVEN,
        methods: Collection[str] = DEFAULT_METHODS,
        routes: Mapping[str, Collection[str]] | None = None,
        require_key: bool = True,
        wait: timedelta | None = None,
        canonicalize_json: bool = True,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        retention: timedelta = DEFAULT_RETENTION,
        two_phase: Collection[str] = (),
        phases: AsyncPhaseStore | None = None,
    ) -> None:
        self.store, self.phases = middleware_stores(
            asynchronous=True,
            app=app,
            key_scope=key_scope,
            pool=pool,
            store=store,
            phases=phases,
            key_store=AsyncKeyStore,
            phase_store=AsyncPhaseStore,
            wait=wait,
            schema=schema,
        )
        self.app = app
        self.pool = middleware_pool(pool, asynchronous=True)
        self.key_scope = key_scope
        self.rules = IdempotencyRules(
            methods=methods,
            routes=routes,
            require_key=require_key,
            canonicalize_json=canonicalize_json,
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
            retention=retention,
            two_phase=two_phase,
        )
        self.methods_for = self.rules.methods_for
        #: How long a duplicate on a two-phase route waits for the holder's answer (None: not).
        self.holder_wait = wait
        self.wait = wait if wait is not None else NO_WAIT
        # None: the store's own wait, which it checked once, not at every claim.
        self._claim_wait = None if self.wait == self.store.wait else self.wait
        #: Whether a prefix written as a full path (root_path included) was reported yet.
        self._warned_full_path = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rules = self.rules
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        root_path = scope.get("root_path")
        if root_path and (rules.routes or rules.two_phase):
            methods, phased = self._mounted(path, root_path)
        else:
            methods = rules.methods_for(path)
            phased = bool(rules.two_phase) and rules.is_two_phase(path)
        if scope["method"] not in methods:
            await self.app(scope, receive, send)
            return
        keys, content_type, content_length = _request_headers(scope["headers"])
        try:
            key = key_of(keys)  # rules.key(), without its call
        except InvalidIdempotencyKey as error:
            await _send(send, semantics.invalid_key(error))
            return
        if key is None:
            if rules.require_key:
                await _send(send, semantics.MISSING_KEY)
            else:
                await self.app(scope, receive, send)
            return
        caller = self.key_scope(scope)
        if caller is not None and not isinstance(caller, str):
            caller = await _awaited_scope(caller)  # an async key scope
        if caller is None:
            await self._unscoped(scope, receive, send)
            return
        body = await self._read_body(receive, send, content_length)
        if body is None:
            return
        # The full path, root_path included, as every fingerprint stored so far was taken.
        fingerprint = request_fingerprint(  # rules.fingerprint(), without its call
            scope["method"],
            path,
            scope.get("query_string", b""),
            body,
            content_type=content_type,
            canonicalize_json=rules.canonicalize_json,
        )
        if phased:
            await self._handle_phased(scope, receive, send, caller, key, fingerprint, body)
        else:
            await self._handle(scope, receive, send, caller, key, fingerprint, body)

    def _mounted(self, path: str, root_path: str) -> tuple[frozenset[str], bool]:
        """The methods that need idempotency on a request to an application mounted under
        ``root_path`` (Starlette's ``Mount``, uvicorn's ``--root-path``), and whether it is served
        in two-phase mode.

        ``routes`` and ``two_phase`` name paths inside the application, as under the WSGI and
        Django adapters (``PATH_INFO``): ASGI's ``path`` includes ``root_path``, which is taken
        off first. A prefix written as the full path still matches when no prefix matches the
        path inside (deprecated, logged once).
        """
        rules = self.rules
        inside = _inside_path(path, root_path)
        if inside is None:
            return rules.methods_for(path), bool(rules.two_phase) and rules.is_two_phase(path)
        methods = rules.route_methods(inside)
        if methods is None:
            methods = rules.route_methods(path)
            if methods is None:
                methods = rules.methods
            else:
                self._matched_full_path("routes", path, root_path)
        phased = False
        if rules.two_phase:
            phased = rules.is_two_phase(inside)
            if not phased and rules.is_two_phase(path):
                phased = True
                self._matched_full_path("two_phase", path, root_path)
        return methods, phased

    def _matched_full_path(self, option: str, path: str, root_path: str) -> None:
        """Say once that a prefix of ``option`` matched only the full path (``root_path``
        included): deprecated, as prefixes name the path inside the application."""
        if self._warned_full_path:
            return
        self._warned_full_path = True
        message = (
            f"IdempotencyMiddleware: a {option} prefix matched the request's full path {path!r}, "
            f"which includes the root_path {root_path!r} the application is mounted under. "
            "Prefixes name the path inside the application (as under the WSGI and Django "
            "adapters): write them without the root_path. Full paths still match when no "
            "prefix matches the path inside, but will stop matching in a future release"
        )
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        _log.warning(message)

    async def _unscoped(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the application without a claim: the key scope named no caller. An endpoint that
        asks for the claim's transaction gets the 401 of :data:`semantics.MISSING_SCOPE`."""
        app_scope = dict(scope)
        app_scope["state"] = {**(scope.get("state") or {}), STATE_KEY: semantics.UNSCOPED}
        started = False
        held: list[Message] = []  # a 5xx answer, held until the application is done

        async def watched(message: Message) -> None:
            nonlocal started
            if held:
                held.append(message)
                return
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 500:
                    # Starlette's error middleware (inside this one when it wraps the whole
                    # application) answers MissingKeyScope with its 500 and then raises it:
                    # held back, so that the 401 replaces it.
                    held.append(message)
                    return
            await send(message)

        try:
            await self.app(app_scope, receive, watched)
        except MissingKeyScope:
            if started and not held:
                raise
            await _send(send, semantics.MISSING_SCOPE)
            return
        except Exception:
            for message in held:
                await send(message)
            raise
        for message in held:
            await send(message)

    async def _read_body(
        self, receive: Receive, send: Send, declared: bytes | None
    ) -> bytes | None:
        """The whole request body; ``None`` once a 413 was sent or the client went away."""
        rules = self.rules
        # rules.declared_too_large(), without its call.
        if (
            declared
            and declared.isascii()  # "²".isdigit(), and int() refuses it
            and declared.isdigit()
            and int(declared) > rules.max_request_bytes
        ):
            await _send(send, rules.request_too_large)
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > rules.max_request_bytes:
                await _send(send, rules.request_too_large)
                return None
            if not message.get("more_body", False):
                # Most bodies arrive in one message: no copy then.
                return b"".join((*chunks, chunk)) if chunks else chunk
            chunks.append(chunk)

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
                        status = conn.pgconn.transaction_status
                        if status == _IDLE and (captured.stored or not captured.undone):
                            # The endpoint committed or rolled back the request's transaction
                            # itself and ran nothing since: the claim is settled on its own,
                            # never left in flight, and the log says what was wrong. (Not a
                            # failed endpoint's: SQLAlchemy rolled back after a failed flush.)
                            await self._settle(conn, claim, captured)
                        elif not captured.commits(status):
                            await conn.rollback()
                        else:
                            try:
                                committed = await self.store.commit(
                                    conn, claim, captured.response()
                                )
                            except EndedThenWrote as error:
                                # The endpoint ended the request's transaction and wrote on in
                                # the one psycopg opened next: commit() found the end and
                                # rolled back what ran after it, and the endpoint's answer was
                                # made after it (a 201 may name a row never made): neither sent
                                # nor stored. The claim stays as the end left it.
                                captured.ended_then_wrote(
                                    claim, error, committed=await self.store.committed(conn, claim)
                                )
                            else:
                                if not committed:
                                    # The completion and COMMIT in one round trip (a failed
                                    # completion raises, and the transaction is rolled back).
                                    captured.claim_lost(claim)
                    except _UNAVAILABLE as error:
                        await rollback_quietly(conn)
                        if captured is None:
                            raise
                        captured.unavailable = True
                        semantics.log_unavailable(claim.scope, error)
                    except BaseException:
                        await rollback_quietly(conn)
                        raise
        except KeyMismatch:
            await _send(send, semantics.MISMATCH)
            return
        except _UNAVAILABLE as error:
            # Before the endpoint began: the claim (or the pool) could not reach the database.
            _log_pool_closed(error)
            await _send(send, semantics.unavailable(self.store.retry_after))
            return
        # After the commit (or the rollback): the client never sees an answer that did not
        # commit.
        if captured is not None and captured.stored and not captured.unavailable:
            # _reply() of a stored answer (complete, within the limit, never ended: see keep()
            # and ended_by_endpoint()) to a won claim, without its calls: the application's
            # answer with the key's expiry, as _answer() and _forward() send it.
            await send(
                {
                    "type": "http.response.start",
                    "status": captured.status,
                    "headers": [
                        *captured.headers,
                        self.rules.expires_header(claim.claimed_at),  # type: ignore[union-attr]
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b"".join(captured.body)})
            return
        await self._reply(send, captured, claim)

    async def _settle(
        self, conn: AsyncConnection[Any], claim: Won, captured: CapturedResponse
    ) -> None:
        """Complete (or release) ``claim`` in a transaction of its own on the idle ``conn``,
        after the endpoint ended the request's transaction (see
        :meth:`~pgonce.http.semantics.CapturedResponse.ended_by_endpoint`)."""
        found: bool | None = None
        # A transaction() block: on a pool of autocommit connections there is no implicit one.
        async with conn.transaction():
            if captured.stored:
                found = await self.store.complete(conn, claim, captured.response())
            else:
                await self.store.release(conn, claim)
        captured.ended_by_endpoint(claim, found=found)

    async def _reply(
        self, send: Send, captured: CapturedResponse | None, claim: Won | Replay | InFlight
    ) -> None:
        """The answer to a request whose claim was decided and whose work has ended."""
        if captured is not None and captured.unavailable:
            await _send(send, semantics.unavailable(self.store.retry_after))
        elif captured is not None:
            await self._answer(send, captured, claim)
        elif isinstance(claim, Replay):
            await _send(send, self.rules.replay(claim))
        else:
            assert isinstance(claim, InFlight)
            await _send(send, semantics.in_flight(claim))

    async def _handle_phased(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        caller: str,
        key: str,
        fingerprint: bytes,
        body: bytes,
    ) -> None:
        """A request on a two-phase route: the claim commits at once, the endpoint runs its
        phases, the answer is stored with the holder's token; then the answer is sent."""
        captured: CapturedResponse | None = None
        try:
            async with self.pool.connection() as conn:
                waiting = HolderWait(self.holder_wait, time.monotonic)
                op = await self.phases.start(conn, caller, key, fingerprint)
                # A duplicate waits (bounded) for the holder's answer, then replays it, takes
                # over a holder that failed, or is answered in flight.
                while op.in_flight and (pause := waiting.pause()):
                    await asyncio.sleep(pause)
                    op = await self.phases.start(conn, caller, key, fingerprint)
                if op.won:
                    captured, began = await self._run_phased(scope, receive, send, op, body)
                    if captured.stored:
                        captured.stored = await op.finish(captured.response())
                    elif not began and not op.resumed:
                        # Refused before the endpoint began (401, 422): nothing ran, and the
                        # key is freed as a one-transaction route's rollback frees it; a
                        # lease ended instead would keep the key in flight for ever. A key
                        # taken over is not freed: an earlier holder may have called the
                        # third party (PhasedOperation.release()).
                        await op.release()
                    else:
                        captured.resumable = True
                        await op.fail(not_stored_note(captured.status))
        except KeyMismatch:
            await _send(send, semantics.MISMATCH)
            return
        except LeaseLost:
            # This holder outlived its lease and a retry took the key over: the answer is the
            # new holder's, which this client gets by retrying.
            await _send(send, semantics.in_flight(InFlight(self.phases.retry_after, "leased")))
            return
        except _UNAVAILABLE as error:
            _log_pool_closed(error)
            await _send(send, semantics.unavailable(self.phases.retry_after))
            return
        except Exception as error:
            if not semantics.went_away_in_sqlalchemy(error):
                raise
            await _send(send, semantics.unavailable(self.phases.retry_after))
            return
        await self._reply(send, captured, op.claim)

    async def _run_phased(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        op: AsyncPhasedOperation[Any],
        body: bytes,
    ) -> tuple[CapturedResponse, bool]:
        """Run the application with the two-phase operation; its captured response, and whether
        the endpoint began (took its operation).

        An exception from the application ends the lease (the next retry resumes from the
        recovery point) and propagates.
        """
        holder = PhasedRequest(op)
        captured = await self._call_app(_app_scope(scope, PHASED_KEY, holder), receive, send, body)
        if captured.failed is not None:
            error = captured.failed
            if not isinstance(error, LeaseLost):
                await op.fail(failure_note(error))
            raise error
        captured.keep(began=holder.began, status_kept=self.phases.stores_status)
        return captured, holder.began

    async def _call_app(
        self, app_scope: Scope, receive: Receive, send: Send, body: bytes
    ) -> _Captured:
        """The application's response to the request, captured; its exception in ``failed``
        (after forwarding an answer it gave before raising)."""
        captured = _Captured(self.rules.max_response_bytes)
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
            elif message["type"] == "http.response.body":
                captured.add(message.get("body", b""), message.get("more_body", False))
                if captured.too_large:
                    # Its answer is decided (the 500 problem): stop the application, whose
                    # stream may never end, rather than read the rest of it.
                    raise _ResponseTooLarge

        try:
            await self.app(app_scope, replay_body, capture)
        except _ResponseTooLarge:
            pass
        except BaseException as error:
            # Starlette's error handler answers, then raises: its error answer goes out. A
            # success answered before the raise (a background task that failed after the
            # response) does not: nothing of the request commits, so the server's 500 does.
            if captured.answered and captured.error_status:
                await _forward(send, captured, [])
            captured.failed = error
        return captured

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
        captured = await self._call_app(_app_scope(scope, STATE_KEY, tx), receive, send, body)
        error = captured.failed
        if error is not None:
            if not captured.answered and (
                isinstance(error, _UNAVAILABLE) or semantics.went_away_in_sqlalchemy(error)
            ):
                # The endpoint's own statements lost the database (through psycopg, or a
                # SQLAlchemy session on it or on another engine): its transaction is gone.
                captured.unavailable = True
                semantics.log_unavailable(claim.scope, error)
                return captured
            raise error
        captured.undone = failed = tx.failed
        # captured.keep(), without its call: the same decision (the store's stores_status()
        # still judges the status).
        status = captured.status
        captured.stored = (
            tx.began
            and not failed
            and status is not None
            and captured.complete
            and not captured.too_large
            and status != TOO_MANY_REQUESTS
            and self.store.stores_status(status)
        )
        return captured

    async def _answer(
        self, send: Send, captured: CapturedResponse, claim: Won | Replay | InFlight
    ) -> None:
        """Send the application's own answer, after its transaction committed or rolled back."""
        if captured.ended:
            await _send(send, captured.ended_answer)
            return
        if not captured.answered:
            if captured.too_large:
                await _send(send, semantics.response_too_large(captured))
            # Otherwise the application never answered: the server reports that as a 500.
            return
        extra: list[tuple[bytes, bytes]] = []
        if captured.stored and isinstance(claim, Won):
            extra.append(self.rules.expires_header(claim.claimed_at))
        await _forward(send, captured, extra)


def _app_scope(scope: Scope, name: str, value: object) -> Scope:
    """The application's scope: ``value`` in its state under ``name``, and without the
    extensions that would send a response around the capture."""
    app_scope = dict(scope)
    app_scope["state"] = {**(scope.get("state") or {}), name: value}
    extensions = scope.get("extensions")
    if extensions and any(name in extensions for name in _BYPASSING_EXTENSIONS):
        app_scope["extensions"] = {
            k: v for k, v in extensions.items() if k not in _BYPASSING_EXTENSIONS
        }
    return app_scope


_log = logging.getLogger("pgonce.http")


def _inside_path(path: str, root_path: str) -> str | None:
    """``path`` without the ``root_path`` it starts with (``"/"`` for the root itself): the path
    inside the application; ``None`` when ``path`` is not under ``root_path`` (e.g. a server
    that leaves ``root_path`` out of ``path``, as the ASGI specification once had it)."""
    root = root_path.rstrip("/")
    if not path.startswith(root):
        return None
    inside = path[len(root) :]
    if not inside:
        return "/"
    return inside if inside[0] == "/" else None


async def _awaited_scope(value: object) -> str | None:
    """What an async key scope named; a :class:`UsageError` for anything but text or None
    (a tenant's number, say), rather than a TypeError from ``await`` or the key store."""
    if inspect.isawaitable(value):
        value = await value
        if value is None or isinstance(value, str):
            return value
    raise UsageError(
        f"key_scope returned {type(value).__name__}: it must return the caller's scope as a "
        "str, or None to leave the request alone (or an awaitable of either)"
    )


def _log_pool_closed(error: BaseException) -> None:
    """Name a pool that is not open (never opened, or closed while the server still serves):
    not an outage that ends by itself, so the 503 it answers must not be the only trace."""
    if isinstance(error, PoolClosed):
        _log.error(
            "idempotent request answered 503: the middleware's connection pool is not open "
            "(%s). Open it before the server serves requests, e.g. in the application's "
            "lifespan (the lifespan of an application mounted in another does not run), and "
            "close it only after",
            error,
        )


class _ResponseTooLarge(Exception):
    """Raised to the application from ``send`` once its response exceeds
    ``max_response_bytes``."""


class _Captured(CapturedResponse):
    """A captured response, and the exception the application raised instead, if it did."""

    # Class attributes as CapturedResponse's defaults are: set only where they differ.
    failed: BaseException | None = None
    #: The endpoint marked its work failed (:meth:`IdempotentTransaction.fail`).
    undone: bool = False

    @property
    def error_status(self) -> bool:
        """Whether the status says the request failed (4xx or 5xx)."""
        return self.status is not None and self.status >= 400


#: The request headers :func:`_request_headers` reads.
_READ_HEADERS = frozenset({KEY_HEADER, b"content-type", b"content-length"})


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
        if name not in _READ_HEADERS:
            continue  # most of a request's headers: one test each, not three
        if name == KEY_HEADER:
            keys.append(value)
        elif name == b"content-type":
            if content_type is None:
                content_type = value.decode("latin-1")
        elif content_length is None:  # Content-Length
            content_length = value
    return keys, content_type, content_length


async def _send(send: Send, answer: Answer) -> None:
    await send({"type": "http.response.start", "status": answer.status, "headers": answer.headers})
    await send({"type": "http.response.body", "body": answer.body})


async def _forward(
    send: Send, captured: CapturedResponse, extra: list[tuple[bytes, bytes]]
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": captured.status,
            "headers": [*captured.headers, *extra],
        }
    )
    await send({"type": "http.response.body", "body": b"".join(captured.body)})
