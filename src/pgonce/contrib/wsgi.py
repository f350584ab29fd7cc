"""Idempotency-Key for any WSGI application, on the sync key store and a psycopg connection pool.

For a request that needs idempotency (POST and PATCH by default, per route configurable) the
middleware reads the request body, takes a connection from the application's
:class:`~psycopg_pool.ConnectionPool`, opens a transaction and claims ``(scope, key)`` in it
(BEGIN and the claim in one round trip). On a won claim it runs the application with that
transaction in the environ (:func:`transaction_of`), buffers the response, stores it and commits --
the claim, the application's writes and the stored response commit in ONE transaction -- and only
then answers. A worker killed at any point leaves either everything or nothing: PostgreSQL rolls
back the dead connection's transaction, and the key is free for the retry.

Every decision and every answer (400, 401, 409, 413, 422, 500 for a response too large to store,
503, replays and ``Idempotency-Key-Expires``) comes from :mod:`pgonce.http.semantics`, shared with
the ASGI middleware and the Django adapter; this module only translates WSGI's environ,
``start_response`` and body iterable onto it.

Why a framework-neutral middleware with a thin Flask module beside it (:mod:`pgonce.contrib.flask`)
rather than a Flask-only one: nothing in the translation needs Flask -- the environ, the response
iterable and the connection are all WSGI's -- so Bottle, Falcon, Pyramid or a bare WSGI callable
get the same middleware, and Flask adds only what is Flask's (the request-scoped accessor and the
401 for a view that asks for the claim of an anonymous request).

The endpoint *began*, and its answer is stored, once it took the claim's connection (or called
:meth:`IdempotentTransaction.begin`): a 400 or 401 that the application gives before touching
the database is not kept, so the corrected retry runs.

Not supported: a repeated Idempotency-Key header is indistinguishable from one key containing a
comma, because WSGI servers join repeated headers with a comma before the middleware sees them; a
request body without ``Content-Length`` is read only when the server says the input is
terminated (``wsgi.input_terminated``: gunicorn, Werkzeug's server), as PEP 3333 has it.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from datetime import timedelta
from http import HTTPStatus
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import psycopg
from psycopg import Connection

from pgonce.core.leases import failure_note, not_stored_note
from pgonce.core.outcomes import TOO_MANY_REQUESTS, Claim, InFlight, Replay, Won
from pgonce.core.requests import request_fingerprint
from pgonce.errors import (
    DatabaseUnavailable,
    InvalidIdempotencyKey,
    KeyMismatch,
    LeaseLost,
    MissingKeyScope,
    UsageError,
)
from pgonce.http import semantics
from pgonce.http.keys import parse_key
from pgonce.http.replay import EXPIRES_HEADER
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
from pgonce.store._sync.keys import EndedThenWrote, KeyStore, rollback_quietly
from pgonce.store._sync.phases import PhasedOperation, PhaseStore

if TYPE_CHECKING:
    # Only a type here: the middleware takes any ConnectionSource (the ``wsgi`` extra installs
    # psycopg_pool, whose ConnectionPool is the usual one).
    from psycopg_pool import ConnectionPool


Environ = dict[str, Any]
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]
Headers = list[tuple[str, str]]
Write = Callable[[bytes], object]
StartResponse = Callable[..., Write]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

#: Names the key store scope of a request (the caller: principal, API key, tenant) from the
#: WSGI environ, or ``None`` to pass the request on without a claim (no credentials).
KeyScope = Callable[[Environ], "str | None"]

#: Where the middleware puts the request's :class:`IdempotentTransaction` in the environ.
ENVIRON_KEY = "pgonce.transaction"
#: Where the middleware puts a two-phase request's operation holder in the environ.
PHASED_ENVIRON_KEY = "pgonce.phased"

__all__ = [
    "ENVIRON_KEY",
    "ConnectionSource",
    "IdempotencyMiddleware",
    "IdempotentTransaction",
    "connection_of",
    "header_scope",
    "phased_of",
    "transaction_of",
]


class ConnectionSource(Protocol):
    """Where the middleware takes a connection for a request: a ``ConnectionPool``, or anything
    with the same ``connection()``. The connection must come idle; the middleware owns the
    transaction it opens on it and ends it before giving the connection back."""

    def connection(self) -> AbstractContextManager[Connection[Any]]: ...


#: Failures that mean "the database went away", not "the code is wrong" (as in the ASGI
#: middleware): a lost or refused connection, the pool's timeout (psycopg_pool's PoolTimeout is
#: an OperationalError), and pgonce's translation.
_UNAVAILABLE = (DatabaseUnavailable, psycopg.OperationalError)
#: A transaction in which a statement failed (what CapturedResponse.commits() refuses).
_INERROR = psycopg.pq.TransactionStatus.INERROR


class IdempotentTransaction:
    """The claimed key's transaction, handed to one request's application."""

    __slots__ = ("_connection", "began", "failed", "key", "scope")

    def __init__(self, connection: Connection[Any], scope: str, key: str) -> None:
        self._connection: Connection[Any] | None = connection
        self.scope = scope
        self.key = key
        #: True once the application took the connection or called :meth:`begin`.
        self.began = False
        #: True once the application's work failed (see :meth:`fail`).
        self.failed = False

    @property
    def connection(self) -> Connection[Any]:
        """The connection, inside the claim's transaction; taking it marks the endpoint as begun.

        Never commit or roll back on it: the middleware commits after storing the response.
        Raises :class:`UsageError` once the request's transaction ended (in the response
        iterable's ``close()``, a Flask ``call_on_close`` function): the connection went back to
        the pool.
        """
        self.began = True
        if self._connection is None:
            raise UsageError(
                "the request's idempotent transaction has ended: its connection went back to the "
                "pool once the response was stored and committed (the response's close() and "
                "Flask's call_on_close functions run after that); use a connection of your own"
            )
        return self._connection

    def begin(self) -> None:
        """Mark the endpoint as begun without using the database (its response will be stored)."""
        self.began = True

    def fail(self) -> None:
        """Mark the application's work as failed although it answers: a framework that turns
        the view's exception into a response (Flask's error handlers, ``abort()``) calls it, so
        that the transaction rolls back and the answer is not stored; the retry runs again."""
        self.failed = True


def transaction_of(environ: Mapping[str, Any]) -> IdempotentTransaction:
    """The request's :class:`IdempotentTransaction`, from its WSGI environ.

    Raises :class:`UsageError` when the middleware claimed no key for this request, and
    :class:`MissingKeyScope` (answered 401 by the middleware) when it could not, because the key
    scope named no caller.
    """
    tx = environ.get(ENVIRON_KEY)
    if tx == semantics.UNSCOPED:
        raise MissingKeyScope()
    if not isinstance(tx, IdempotentTransaction):
        raise UsageError(
            "this request has no idempotent transaction: the route must be covered by "
            "pgonce's WSGI IdempotencyMiddleware and carry an Idempotency-Key (check its "
            "methods and routes)"
        )
    return tx


def connection_of(environ: Mapping[str, Any]) -> Connection[Any]:
    """The claim's connection, from the WSGI environ (marks the endpoint as begun)."""
    return transaction_of(environ).connection


def phased_of(environ: Mapping[str, Any]) -> PhasedOperation[Any]:
    """The two-phase operation of a request on one of the middleware's ``two_phase`` routes.

    The view runs its phases on it and returns its response as usual; the middleware stores it
    with the holder's fencing token. Raises :class:`UsageError` on any other route.
    """
    if environ.get(ENVIRON_KEY) == semantics.UNSCOPED:
        raise MissingKeyScope()
    holder = environ.get(PHASED_ENVIRON_KEY)
    if not isinstance(holder, PhasedRequest):
        raise UsageError(
            "this request has no two-phase operation: its route must be among the "
            "IdempotencyMiddleware's two_phase routes, with an Idempotency-Key"
        )
    operation: PhasedOperation[Any] = holder.operation
    return operation


def header_scope(name: str, *, prefix: str = "") -> KeyScope:
    """A key scope from a request header (an API key, a tenant id); ``None`` when it is absent.

    The value is stored as its SHA-256, so that a credential never lands in the key store.
    """
    wanted = "HTTP_" + name.upper().replace("-", "_")

    def scope_of(environ: Environ) -> str | None:
        value = environ.get(wanted)
        if not value:
            return None
        return prefix + hashlib.sha256(value.encode("latin-1")).hexdigest()

    return scope_of


class IdempotencyMiddleware:
    """WSGI middleware that makes POST and PATCH safe to retry with an Idempotency-Key.

    ``pool`` is the application's opened :class:`~psycopg_pool.ConnectionPool` (size it for the
    server's threads: each covered request holds a connection while the application runs), or
    another :class:`ConnectionSource`. ``key_scope`` is required: it names whose key a request
    carries from the environ (:func:`header_scope` makes one from a header). The other options
    are the ASGI middleware's: ``routes`` maps path prefixes to methods (the longest prefix
    wins; an empty collection turns a route off), ``require_key`` answers 400 to a covered
    request without a key, ``wait`` lets a duplicate wait that long for the original and then
    replay (``None``: 409 at once; on a two-phase route too), ``store`` defaults to a
    :class:`~pgonce.KeyStore` on ``schema`` with that wait. ``two_phase`` lists path prefixes
    served in two-phase mode (the view takes its operation with :func:`phased_of`), on
    ``phases`` (a :class:`~pgonce.phases.PhaseStore` with the key store's settings by default).
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        pool: ConnectionPool[Any] | ConnectionSource,
        key_scope: KeyScope,
        store: KeyStore | None = None,
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
        phases: PhaseStore | None = None,
    ) -> None:
        self.store, self.phases = middleware_stores(
            asynchronous=False,
            app=app,
            key_scope=key_scope,
            pool=pool,
            store=store,
            phases=phases,
            key_store=KeyStore,
            phase_store=PhaseStore,
            wait=wait,
            schema=schema,
        )
        self.app = app
        self.pool = middleware_pool(pool, asynchronous=False)
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
        #: How long a duplicate on a two-phase route waits for the holder's answer (None: not).
        self.holder_wait = wait
        self.wait = wait if wait is not None else NO_WAIT
        # None: the store's own wait, which it checked once, not at every claim.
        self._claim_wait = None if self.wait == self.store.wait else self.wait
        self._status_kept = self.store.stores_status
        # What the view's database going away looks like: answered 503 (with Retry-After), as
        # Flask's Idempotency answers it, never the server's 500. Looked up here, once.
        self._unavailable: tuple[type[Exception], ...] = (
            *_UNAVAILABLE,
            *semantics.sqlalchemy_unavailable(),
        )

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        # The request's key, or an answer to give at once, or the request passed through. (One
        # method on the path every request takes: each environ entry is looked up once.)
        rules = self.rules
        method = environ["REQUEST_METHOD"]
        path = environ.get("PATH_INFO", "")
        # rules.applies(), without its calls on a middleware with no routes.
        if method not in (rules.methods_for(path) if rules.routes else rules.methods):
            return self.app(environ, start_response)
        value = environ.get("HTTP_IDEMPOTENCY_KEY")
        if value is None:
            if rules.require_key:
                return _answer(start_response, semantics.MISSING_KEY)
            return self.app(environ, start_response)
        try:
            key = parse_key(value)  # rules.joined_key()
        except InvalidIdempotencyKey as error:
            return _answer(start_response, semantics.invalid_key(error))
        # rules.declared_too_large(), the declared size read once for _read_body() too.
        declared = environ.get("CONTENT_LENGTH")
        size = int(declared) if declared and declared.isascii() and declared.isdigit() else None
        if size is not None and size > rules.max_request_bytes:
            return _answer(start_response, rules.request_too_large)
        caller = self.key_scope(environ)
        if caller is None:
            return self._unscoped(environ, start_response)
        try:
            body = self._read_body(environ, size)
        except _IncompleteBody as cut:
            return _answer(start_response, cut.answer)
        if body is None:
            return _answer(start_response, rules.request_too_large)
        fingerprint = request_fingerprint(  # rules.fingerprint()
            method,
            environ.get("SCRIPT_NAME", "") + path,
            environ.get("QUERY_STRING", "").encode("latin-1"),
            body,
            content_type=environ.get("CONTENT_TYPE"),
            canonicalize_json=rules.canonicalize_json,
        )
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        if rules.two_phase and rules.is_two_phase(path):
            return self._handle_phased(environ, start_response, caller, key, fingerprint)
        return self._handle(environ, start_response, caller, key, fingerprint)

    def _read_body(self, environ: Environ, size: int | None) -> bytes | None:
        """The whole request body; ``None`` when it exceeds ``max_request_bytes``.

        Raises :class:`_IncompleteBody` when the body ends before its ``Content-Length``: the
        client went away while sending it, and the server's input (gunicorn's) returns what
        came, short and without an error. The application gets the body as read here, with a
        ``Content-Length`` to match, so it could no longer tell (``amount=10`` of
        ``amount=1000`` is a valid form); and a claim of the cut body would answer the retry of
        the whole one 422.
        """
        stream = environ["wsgi.input"]
        if size is not None:
            # The declared Content-Length, not over max_request_bytes: __call__() answered 413
            # to a declared size over it.
            body: bytes = stream.read(size)
            if len(body) == size:
                return body
            raise _IncompleteBody(len(body), size)
        if not environ.get("wsgi.input_terminated"):
            return b""  # PEP 3333: without a Content-Length there is no body to read
        limit = self.rules.max_request_bytes
        chunks: list[bytes] = []
        size = 0
        while chunk := stream.read(64 * 1024):
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    def _unscoped(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        """Run the application without a claim: the key scope named no caller. An endpoint that
        asks for the claim's transaction gets the 401 of :data:`semantics.MISSING_SCOPE`."""
        environ[ENVIRON_KEY] = semantics.UNSCOPED
        started: list[bool] = []

        def start(status: str, headers: Headers, exc_info: ExcInfo | None = None) -> Write:
            started.append(True)
            return start_response(status, headers, exc_info)

        try:
            result = self.app(environ, start)
        except MissingKeyScope:
            return _answer(start_response, semantics.MISSING_SCOPE)
        return _unscoped_body(result, start_response, started)

    def _handle(
        self,
        environ: Environ,
        start_response: StartResponse,
        caller: str,
        key: str,
        fingerprint: bytes,
    ) -> Iterable[bytes]:
        captured: _Captured | None = None
        try:
            with self.pool.connection() as conn:
                claim = self.store.begin(conn, caller, key, fingerprint, wait=self._claim_wait)
                if isinstance(claim, Won):
                    tx = IdempotentTransaction(conn, claim.scope, claim.key)
                    environ[ENVIRON_KEY] = tx
                    try:
                        # The application runs in the claim's transaction; an exception from it
                        # propagates (the transaction rolls back, and the server answers 500).
                        captured = self._capture(environ)
                        # captured.keep(), without its call: the same decision (the store's
                        # stores_status() still judges the status).
                        answered = captured.status
                        captured.stored = (
                            tx.began
                            and not tx.failed
                            and answered is not None
                            and captured.complete
                            and not captured.too_large
                            and answered != TOO_MANY_REQUESTS
                            and self._status_kept(answered)
                        )
                        status = conn.pgconn.transaction_status
                        if status == _IDLE and (captured.stored or not tx.failed):
                            # The view committed or rolled back the request's transaction
                            # itself and ran nothing since: the claim is settled on its own,
                            # never left in flight, and the log says what was wrong. (Not a
                            # failed view's: SQLAlchemy rolled back after a failed flush.)
                            self._settle(conn, claim, captured)
                        elif status == _INERROR or not captured.stored:
                            # captured.commits(), without its call: a transaction in which a
                            # statement failed cannot commit, nor is its answer stored.
                            captured.stored = False
                            conn.rollback()
                        else:
                            try:
                                committed = self.store.commit(conn, claim, captured.response())
                            except EndedThenWrote as error:
                                # The view ended the request's transaction and wrote on in the
                                # one psycopg opened next: commit() found the end and rolled
                                # back what ran after it, and the view's answer was made after
                                # it (a 201 may name a row never made): neither sent nor stored.
                                # The claim stays as the end left it.
                                captured.ended_then_wrote(
                                    claim, error, committed=self.store.committed(conn, claim)
                                )
                            else:
                                if not committed:
                                    # The completion and COMMIT in one round trip (a failed
                                    # completion raises, and the transaction is rolled back).
                                    captured.claim_lost(claim)
                    except self._unavailable as error:
                        rollback_quietly(conn)
                        if captured is None:
                            raise
                        captured.unavailable = True
                        semantics.log_unavailable(claim.scope, error)
                    except BaseException:
                        rollback_quietly(conn)
                        if captured is not None:
                            captured.close()
                        raise
                    finally:
                        # The connection goes back to the pool: the response's close() (run by
                        # the server after sending) must not write on it.
                        tx._connection = None
        except KeyMismatch:
            return _answer(start_response, semantics.MISMATCH)
        except self._unavailable:
            # Before the endpoint began: the claim (or the pool) could not reach the database.
            if captured is not None:
                captured.close()
            return _answer(start_response, semantics.unavailable(self.store.retry_after))
        # After the commit (or the rollback): the client never sees an answer that did not
        # commit.
        if captured is not None:
            return self._give(start_response, captured, claim)  # type: ignore[arg-type]
        return self._reply(start_response, captured, claim)

    def _reply(
        self, start_response: StartResponse, captured: _Captured | None, claim: Claim
    ) -> Iterable[bytes]:
        """The answer to a request whose claim was decided and whose work has ended."""
        if captured is not None:
            assert isinstance(claim, Won)
            return self._give(start_response, captured, claim)
        if isinstance(claim, Replay):
            return _answer(start_response, self.rules.replay(claim))
        assert isinstance(claim, InFlight)
        return _answer(start_response, semantics.in_flight(claim))

    def _settle(self, conn: Connection[Any], claim: Won, captured: CapturedResponse) -> None:
        """Complete (or release) ``claim`` in a transaction of its own on the idle ``conn``,
        after the view ended the request's transaction (see
        :meth:`~pgonce.http.semantics.CapturedResponse.ended_by_endpoint`)."""
        found: bool | None = None
        # A transaction() block, not the connection's implicit transaction and commit(): on a
        # pool of autocommit connections there is none, and the completion would be refused
        # (NotInTransaction), the key left in flight after the view had committed its claim.
        with conn.transaction():
            if captured.stored:
                found = self.store.complete(conn, claim, captured.response())
            else:
                self.store.release(conn, claim)
        captured.ended_by_endpoint(claim, found=found)

    def _handle_phased(
        self,
        environ: Environ,
        start_response: StartResponse,
        caller: str,
        key: str,
        fingerprint: bytes,
    ) -> Iterable[bytes]:
        """A request on a two-phase route: the claim commits at once, the view runs its phases,
        the answer is stored with the holder's token; then the answer is given."""
        captured: _Captured | None = None
        try:
            with self.pool.connection() as conn:
                waiting = HolderWait(self.holder_wait, time.monotonic)
                op = self.phases.start(conn, caller, key, fingerprint)
                # A duplicate waits (bounded) for the holder's answer, then replays it, takes
                # over a holder that failed, or is answered in flight.
                while op.in_flight and (pause := waiting.pause()):
                    time.sleep(pause)
                    op = self.phases.start(conn, caller, key, fingerprint)
                if op.won:
                    holder = PhasedRequest(op)
                    environ[PHASED_ENVIRON_KEY] = holder
                    try:
                        captured = self._capture(environ)
                    except LeaseLost:
                        raise
                    except Exception as error:
                        op.fail(failure_note(error))
                        raise
                    if captured.keep(began=holder.began, status_kept=self.phases.stores_status):
                        captured.stored = op.finish(captured.response())
                    elif not holder.began and not op.resumed:
                        # Refused before the view began (401, 422): nothing ran, and the key
                        # is freed as a one-transaction route's rollback frees it; a lease
                        # ended instead would keep the key in flight for ever. A key taken
                        # over is not freed: an earlier holder may have called the third party
                        # (PhasedOperation.release()).
                        op.release()
                    else:
                        captured.resumable = True
                        op.fail(not_stored_note(captured.status))
        except KeyMismatch:
            return _answer(start_response, semantics.MISMATCH)
        except LeaseLost:
            # Taken over by a retry: the answer is the new holder's.
            if captured is not None:
                captured.close()
            leased = InFlight(self.phases.retry_after, "leased")
            return _answer(start_response, semantics.in_flight(leased))
        except self._unavailable:
            if captured is not None:
                captured.close()
            return _answer(start_response, semantics.unavailable(self.phases.retry_after))
        except BaseException:
            if captured is not None:
                captured.close()
            raise
        return self._reply(start_response, captured, op.claim)

    def _capture(self, environ: Environ) -> _Captured:
        """Run the application and capture its whole response (an exception propagates).

        A body past ``max_response_bytes`` has its answer decided (the 500 problem, nothing
        kept): the rest of it is not read, and the iterable is closed, as a stream that never
        ends (server-sent events) would otherwise hold the request and its key for ever. So is
        the iterable of an application that raised. Otherwise the iterable is closed later
        (:meth:`_Captured.close`): by the server, after sending the answer (PEP 3333), which is
        after the commit -- a Flask ``call_on_close`` function that starts a job finds the
        request's writes committed -- or by the middleware, once the transaction ended, when
        the answer is another (a replay, a 503).
        """
        # self.rules.capture(), without its call.
        captured = _Captured(self.rules.max_response_bytes)
        try:
            result = self.app(environ, captured.start_response)
        except _ResponseTooLarge:  # from write(): see _Captured._write
            return captured
        captured.close_app = getattr(result, "close", None)
        # captured.add() of each chunk, without its call: the size is read from the capture at
        # each chunk, as write() (a generator application's) adds to it too.
        limit = captured.limit
        append = captured.body.append
        try:
            for chunk in result:
                if (size := captured.size + len(chunk)) > limit:
                    captured.add(chunk, True)  # too large: its answer is decided
                    captured.close()
                    return captured
                captured.size = size
                if chunk:
                    append(chunk)
        except _ResponseTooLarge:  # write() called by a generator application
            captured.close()
            return captured
        except BaseException:
            captured.close()
            raise
        captured.complete = True  # captured.add(b"", False)
        return captured

    def _give(
        self, start_response: StartResponse, captured: _Captured, claim: Won
    ) -> Iterable[bytes]:
        """The application's own answer, after its transaction committed or rolled back."""
        if (
            captured.unavailable
            or captured.too_large
            or captured.ended
            or captured.status is None  # not captured.answered, without the property's call
            or not captured.complete
        ):
            # Another answer than the application's: its iterable is closed now, after the
            # transaction ended, not left to a server that never sees it.
            captured.close()
            if captured.unavailable:
                return _answer(start_response, semantics.unavailable(self.store.retry_after))
            if captured.too_large:
                return _answer(start_response, semantics.response_too_large(captured))
            if captured.ended:
                return _answer(start_response, captured.ended_answer)
            raise UsageError("the WSGI application returned without calling start_response()")
        # Set with the status by start_response() (the status is there, so they are too).
        headers = captured.text_headers or []
        if captured.stored:
            # rules.expires_text_header(), without its call.
            headers = [*headers, (EXPIRES_HEADER, self.rules.expires(claim.claimed_at))]
        start_response(captured.status_line, headers)
        close = captured.close_app
        if close is None:
            return captured.body
        # The server closes it after sending the answer (PEP 3333), after the commit.
        body = _Body(captured.body)
        body.close = close
        return body


class _IncompleteBody(Exception):
    """The request body ended before its ``Content-Length`` (see ``_read_body()``)."""

    def __init__(self, received: int, declared: int) -> None:
        super().__init__(received, declared)
        self.answer = semantics.problem(
            400,
            "Request body incomplete",
            f"the request body ended after {received} of the {declared} bytes its "
            "Content-Length declares; nothing was done: send the whole request again with the "
            "same Idempotency-Key",
        )


class _Captured(CapturedResponse):
    """The application's response (its ``start_response`` call and body), held back until the
    commit."""

    # Class attributes as CapturedResponse's defaults are: set only where they differ.
    #: The status line as the application gave it to ``start_response``.
    status_line = ""
    #: The ``close()`` of the application's iterable, until it is called.
    close_app: Callable[[], object] | None = None

    def close(self) -> None:
        """Close the application's iterable (once)."""
        close, self.close_app = self.close_app, None
        if close is not None:
            close()

    def start_response(
        self, status: str, headers: Headers, exc_info: ExcInfo | None = None
    ) -> Write:
        # Nothing was sent yet, so a second call (an error page after a failure, with exc_info)
        # replaces the first, as PEP 3333 allows before the headers went out.
        self.status_line = status
        headers = list(headers)
        self.status = int(status.split(" ", 1)[0])
        # Kept as text (the store keeps text), but only latin-1, as PEP 3333 has it: one
        # encoding of them all raises what encoding each of them would (joined in C, not in a
        # Python loop over the names and values).
        "".join(map("".join, headers)).encode("latin-1")
        self.text_headers = headers
        return self._write

    def _write(self, data: bytes) -> None:
        # The legacy write() callable: its bytes come before the iterable's, as a server sends them.
        self.add(data, more=True)
        if self.too_large:
            # Its answer is decided: stop the application rather than take the rest.
            raise _ResponseTooLarge


class _Body(list[bytes]):
    """The application's captured body, given to the server with the ``close()`` of its iterable,
    which the server calls after sending it (PEP 3333)."""

    __slots__ = ("close",)

    close: Callable[[], object]


class _ResponseTooLarge(Exception):
    """Raised to the application from ``write()`` once its response exceeds
    ``max_response_bytes``."""


def _unscoped_body(
    result: Iterable[bytes], start_response: StartResponse, started: list[bool]
) -> Iterator[bytes]:
    """The body of an unscoped request's application, answered 401 when it asks for the claim's
    transaction lazily (a generator application runs at the server's first ``next()``), before
    its ``start_response()``: as the application that asks at once is, not the server's 500."""
    try:
        iterator = iter(result)
        try:
            first = next(iterator)
        except StopIteration:
            return
        except MissingKeyScope:
            if started:
                raise
            yield from _answer(start_response, semantics.MISSING_SCOPE)
            return
        yield first
        yield from iterator
    finally:
        close = getattr(result, "close", None)
        if close is not None:
            close()


def _status_line(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


def _answer(start_response: StartResponse, answer: Answer) -> Iterator[bytes]:
    start_response(
        _status_line(answer.status),
        [(name.decode("latin-1"), value.decode("latin-1")) for name, value in answer.headers],
    )
    return iter((answer.body,))
