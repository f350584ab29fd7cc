"""Idempotency-Key for Flask: the WSGI middleware of :mod:`pgonce.contrib.wsgi` and Flask accessors.

::

    pool = ConnectionPool(dsn, open=True)
    app = Flask(__name__)
    Idempotency(app, pool=pool, key_scope=header_scope("Authorization"))

    @app.post("/payments")
    def create_payment():
        connection().execute("INSERT INTO payments ...")  # commits with the key, or not at all
        return {"id": ...}, 201

:class:`Idempotency` wraps ``app.wsgi_app`` in the middleware (so it sees every request before
Flask does, and Flask's whole answer, error pages included) and registers two error handlers for
covered requests: a view that asks for the claim of a request whose key scope named no caller is
answered 401 (never a 500), and a view whose database went away is answered 503 with
``Retry-After`` (nothing committed; the retry runs). :func:`connection` and :func:`transaction`
are the request-scoped accessors: the claim's connection is the view's, inside the claim's
transaction. Every HTTP rule is :mod:`pgonce.http.semantics`'s; nothing here decides one.

With SQLAlchemy (Flask-SQLAlchemy's ``db.engine``, or any ``postgresql+psycopg://`` engine): pass
``pool=EngineConnections(engine)`` and write through :func:`session`, a ``Session`` on the claim's
connection and transaction (the extra ``pgonce[sqlalchemy]`` too). Flask-SQLAlchemy's own
``db.session`` runs on another connection of the pool, outside the claim's transaction.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

import psycopg

from pgonce.contrib.wsgi import (
    ENVIRON_KEY,
    ConnectionSource,
    IdempotencyMiddleware,
    IdempotentTransaction,
    KeyScope,
    header_scope,
    transaction_of,
)
from pgonce.errors import DatabaseUnavailable, MissingKeyScope, UsageError
from pgonce.extras import needs
from pgonce.http import semantics
from pgonce.http.semantics import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_METHODS,
    DEFAULT_RETENTION,
    Answer,
)
from pgonce.http.setup import SCHEMA_NOT_GIVEN
from pgonce.store._sync.keys import KeyStore
from pgonce.store._sync.phases import PhaseStore

with needs("flask", "the Flask Idempotency-Key integration"):
    from flask import (
        Flask,
        Response,
        after_this_request,
        current_app,
        g,
        has_request_context,
        request,
    )
    from flask import globals as flask_globals
    from psycopg_pool import ConnectionPool

#: The variable that holds Flask's request context (Flask 2.2 to 3.1); None where a Flask keeps
#: its request elsewhere, and connection() takes the public accessors only.
_request_context: ContextVar[Any] | None = getattr(flask_globals, "_cv_request", None)

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.engine import Engine
    from sqlalchemy.orm import Session

__all__ = [
    "EngineConnections",
    "Idempotency",
    "connection",
    "header_scope",
    "session",
    "transaction",
]

#: Where a request's SQLAlchemy session is kept (``flask.g``), closed when the request ends.
_SESSION = "pgonce_session"
#: Whether the app closes a request's session() when the request ends (``app.extensions``): per
#: app, as one Idempotency may be initialized on several apps (an app factory's).
_CLOSES_SESSIONS = "pgonce.closes_sessions"
#: Set on ``flask.g`` when the request's session was closed: a later session() is refused.
_CLOSED = "pgonce_session_closed"


def transaction() -> IdempotentTransaction:
    """The current request's :class:`~pgonce.contrib.wsgi.IdempotentTransaction`.

    Raises :class:`UsageError` outside a request or on a request the middleware claimed no key
    for, and :class:`MissingKeyScope` (answered 401) when the key scope named no caller.
    """
    if not has_request_context():
        raise UsageError(
            "pgonce.contrib.flask's transaction(), connection() and session() are for use "
            "inside a Flask request: a streamed response's generator runs after the view "
            "returned, outside the request; wrap it in flask.stream_with_context() to use them "
            "there"
        )
    return transaction_of(request.environ)


def connection() -> psycopg.Connection[Any]:
    """The claim's connection, inside its transaction: write on it and the writes commit with the
    key and the stored response. Call it in the view (it marks the view as begun); never commit
    or roll back on it."""
    # transaction()'s common case, without its calls: the request context read from Flask's
    # context variable (has_request_context() and the request proxy each read it again).
    ctx = _request_context.get(None) if _request_context is not None else None
    if ctx is not None:
        tx = ctx.request.environ.get(ENVIRON_KEY)
        if type(tx) is IdempotentTransaction:
            # tx.connection, without the property's call; an ended one raises below.
            tx.began = True
            if (conn := tx._connection) is not None:
                return conn
    return transaction().connection


# The SQLAlchemy connection under each psycopg connection that EngineConnections handed out.
_checked_out: WeakKeyDictionary[psycopg.Connection[Any], SAConnection] = WeakKeyDictionary()


class EngineConnections:
    """The middleware's connections from a SQLAlchemy ``Engine``'s pool (``db.engine``).

    ``Idempotency(app, pool=EngineConnections(db.engine), ...)``: the middleware owns the
    transaction on the connection (BEGIN and the claim, then the completion and COMMIT), and
    :func:`session` gives the view a ``Session`` on that same connection and transaction. The
    engine must be on ``postgresql+psycopg://``.
    """

    def __init__(self, engine: Engine) -> None:
        with needs("sqlalchemy", "EngineConnections"):
            from sqlalchemy.engine import Engine

            from pgonce.contrib.sqlalchemy import NotPsycopgSession
        if not isinstance(engine, Engine):
            raise UsageError("EngineConnections takes a SQLAlchemy Engine (create_engine())")
        if engine.dialect.driver != "psycopg":
            raise NotPsycopgSession(f"{engine.dialect.name}+{engine.dialect.driver}")
        self.engine = engine

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        import sqlalchemy.exc

        from pgonce.contrib.sqlalchemy import _request_owned

        try:
            bound = self.engine.connect()
        except (sqlalchemy.exc.DBAPIError, sqlalchemy.exc.TimeoutError) as error:
            raise DatabaseUnavailable(f"connecting through the engine failed: {error}") from error
        try:
            conn = bound.connection.driver_connection
            if not isinstance(conn, psycopg.Connection):
                raise UsageError("the engine's connections are not psycopg 3 connections")
            # SQLAlchemy's view of the transaction the middleware opens: no SQL is sent. When
            # the connection goes back to the pool the middleware has ended the transaction,
            # and SQLAlchemy's reset finds nothing to roll back.
            bound.begin()
            _request_owned(bound)  # the view's commit() and rollback() of it are refused
            _checked_out[conn] = bound
            try:
                yield conn
            finally:
                _checked_out.pop(conn, None)
        finally:
            bound.close()


def session() -> Session:
    """The request's SQLAlchemy ``Session``, on the claim's connection and transaction.

    The ORM's writes, the claim and the stored response commit together, after the response is
    stored. Pending writes are flushed when the view returns (a flush that fails answers 500 and
    rolls everything back), and those of ``after_request`` and ``teardown_request`` functions
    when the request ends, before the commit. ``session.commit()`` (or its connection's
    ``commit()``) raises
    :class:`~pgonce.contrib.sqlalchemy.SessionCommitRefused`: the middleware commits;
    ``session.rollback()`` raises :class:`~pgonce.contrib.sqlalchemy.SessionRollbackRefused`: it
    would roll back the claim (undo a part with ``session.begin_nested()``). Either refusal, not
    caught by the view, is logged and answered with the problem of
    :data:`~pgonce.http.semantics.TRANSACTION_ENDED`, and nothing of the request commits. Asking
    for it marks the view as begun. Needs ``pool=EngineConnections(engine)``.
    """
    try:
        existing = g.get(_SESSION)
    except RuntimeError:  # Flask's "Working outside of application context"
        transaction()  # the UsageError that says where session() is for
        raise
    if existing is not None:
        return existing  # type: ignore[no-any-return]
    if g.get(_CLOSED):
        # A teardown_request function that runs after the app's: nothing would flush or close
        # the Session returned here, and its writes would be dropped while the answer is stored.
        raise UsageError(
            "session() was called after the request's session was closed (in a "
            "teardown_request function registered before Idempotency): write in the view, an "
            "after_request function or a teardown_request function registered after "
            "Idempotency(app)"
        )
    with needs("sqlalchemy", "pgonce.contrib.flask.session()"):
        from pgonce.contrib.sqlalchemy import _RequestSession
    bound = _checked_out.get(transaction().connection)
    if bound is None or not current_app.extensions.get(_CLOSES_SESSIONS, False):
        # Only an app given EngineConnections itself closes a request's session when the
        # request ends (init_app): one on connections handed on by another source would leak.
        raise UsageError(
            "session() needs the idempotency middleware on EngineConnections(engine): this "
            "request's connection did not come from a SQLAlchemy engine"
        )
    opened = _RequestSession(bind=bound, join_transaction_mode="rollback_only")
    setattr(g, _SESSION, opened)

    @after_this_request
    def flush(response: Response) -> Response:
        opened.flush()
        return response

    return opened


_INTRANS = psycopg.pq.TransactionStatus.INTRANS
_IDLE = psycopg.pq.TransactionStatus.IDLE


def _close_session(error: BaseException | None) -> None:
    setattr(g, _CLOSED, True)
    opened = g.pop(_SESSION, None)
    if opened is None:
        return
    try:
        # What after_request and teardown_request functions added since the view's flush: it
        # commits with the claim, or (a flush that fails here) the request fails and nothing
        # commits; closing the session would drop it while the answer is stored. Not in a
        # request that failed, whose transaction rolls back whatever is flushed.
        tx = request.environ.get(ENVIRON_KEY)
        if error is None and isinstance(tx, IdempotentTransaction) and not tx.failed:
            status = tx.connection.info.transaction_status
            if status == _INTRANS:
                opened.flush()
            elif status == _IDLE and not opened.is_active:
                # A flush failed and SQLAlchemy rolled the request's transaction back (the
                # claim with it), and the view caught the error and answered (a 409 for a
                # duplicate): that answer goes out, not stored, and the retry runs again.
                # (A session still active did not: the view ended the transaction below it,
                # a commit() or rollback() of connection() or a COMMIT in SQL, and the
                # middleware settles the claim as on any pool: failed here, a claim the view
                # had committed was left in flight, and one it had rolled back answered with
                # the view's success.)
                tx.fail()
    finally:
        opened.close()


class Idempotency:
    """The Flask extension: ``Idempotency(app, pool=..., key_scope=...)`` or ``init_app()``.

    The options are :class:`~pgonce.contrib.wsgi.IdempotencyMiddleware`'s; ``key_scope`` is a
    function of the WSGI environ (it runs before Flask's request context exists). A view on a
    ``two_phase`` route takes its operation with ``phased_of(request.environ)``
    (:func:`~pgonce.contrib.wsgi.phased_of`).
    """

    def __init__(self, app: Flask | None = None, **options: Any) -> None:
        self.middleware: IdempotencyMiddleware | None = None
        #: Set by init_app(): whether the app closes a request's session() when the request ends.
        self.closes_sessions = False
        if app is not None:
            self.init_app(app, **options)

    def init_app(
        self,
        app: Flask,
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
    ) -> IdempotencyMiddleware:
        if not isinstance(app, Flask):
            raise UsageError(f"Idempotency needs a Flask app, not {type(app).__name__}")
        if "pgonce" in app.extensions or isinstance(app.wsgi_app, IdempotencyMiddleware):
            # A second middleware would claim each key again, on another connection, and wait
            # for the first one's uncommitted claim, which waits for it: every covered request
            # would be answered 409 "in progress", for ever.
            raise UsageError(
                "Idempotency is already initialized on this app (or its wsgi_app is already an "
                "IdempotencyMiddleware): initialize it once per app, with Idempotency(app, ...) "
                "or init_app(app, ...), not both"
            )
        self.middleware = middleware = IdempotencyMiddleware(
            app.wsgi_app,
            pool=pool,
            key_scope=key_scope,
            store=store,
            schema=schema,
            methods=methods,
            routes=routes,
            require_key=require_key,
            wait=wait,
            canonicalize_json=canonicalize_json,
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
            retention=retention,
            two_phase=two_phase,
            phases=phases,
        )
        app.wsgi_app = middleware  # type: ignore[method-assign]
        app.extensions["pgonce"] = self
        _mark_raised_views(app)
        app.register_error_handler(MissingKeyScope, _missing_scope)
        unavailable = _unavailable(middleware)
        app.register_error_handler(psycopg.OperationalError, unavailable)
        app.register_error_handler(DatabaseUnavailable, unavailable)
        handled = app.error_handler_spec.get(None, {}).get(None, {})
        for error in semantics.sqlalchemy_unavailable():
            # The same failures through SQLAlchemy (session(), or Flask-SQLAlchemy's db.session
            # on another connection), which wraps psycopg's OperationalError in its own and has
            # a pool timeout of its own: a 503 too, not Flask's 500 page. Not where the app
            # handles them itself (this one's re-raise would skip its handler).
            if not any(kind in handled for kind in error.__mro__):
                app.register_error_handler(error, unavailable)
        # Requests can have a session() to close when they end only on EngineConnections
        # (session() refuses one on any other source): only then does the app run the teardown.
        self.closes_sessions = isinstance(pool, EngineConnections)
        app.extensions[_CLOSES_SESSIONS] = self.closes_sessions
        if self.closes_sessions:
            app.teardown_request(_close_session)
            from pgonce.contrib.sqlalchemy import SessionCommitRefused, SessionRollbackRefused

            # The view's commit() or rollback() of the request's session (or of its
            # connection()) is refused, its writes roll back with the claim (see
            # _mark_raised_views), and the client is told so, not given Flask's 500 page.
            app.register_error_handler(SessionCommitRefused, _transaction_ended)
            app.register_error_handler(SessionRollbackRefused, _transaction_ended)
        return middleware


def _response(answer: Answer) -> Response:
    return Response(
        answer.body,
        status=answer.status,
        headers=[
            (name.decode("latin-1"), value.decode("latin-1")) for name, value in answer.headers
        ],
    )


def _missing_scope(error: MissingKeyScope) -> Response:
    return _response(semantics.MISSING_SCOPE)


def _transaction_ended(error: UsageError) -> Response:
    tx = request.environ.get(ENVIRON_KEY)
    if not isinstance(tx, IdempotentTransaction):
        raise error  # not a covered request: the app's own error handling decides
    semantics.log_transaction_ended(tx.scope, error)
    return _response(semantics.TRANSACTION_ENDED)


def _mark_raised_views(app: Flask) -> None:
    """Fail the transaction of a covered request whose view raised, whatever answer Flask makes
    of the exception (``abort(409)``, an error handler's response): its writes roll back with the
    claim and the answer is not stored, so the retry runs the view again.

    Flask turns the exception into a response before the middleware sees it, and tells no one
    of an exception it handled (``got_request_exception`` is for the unhandled ones only), so
    the app's own ``handle_user_exception``, which every exception of a view and of its
    ``before_request`` functions goes through, is wrapped, and so is ``handle_exception``, which
    answers those of ``after_request`` functions.
    """
    handle = app.handle_user_exception
    handle_unhandled = app.handle_exception

    def handle_user_exception(error: Exception) -> Any:
        tx = request.environ.get(ENVIRON_KEY)
        if isinstance(tx, IdempotentTransaction):
            tx.fail()
        return handle(error)

    def handle_exception(error: Exception) -> Any:
        # What Flask answers 500 without the user's handlers: an exception of an after_request
        # function, after the view wrote.
        tx = request.environ.get(ENVIRON_KEY)
        if isinstance(tx, IdempotentTransaction):
            tx.fail()
        return handle_unhandled(error)

    app.handle_user_exception = handle_user_exception  # type: ignore[method-assign,assignment]
    app.handle_exception = handle_exception  # type: ignore[method-assign,assignment]


def _unavailable(middleware: IdempotencyMiddleware) -> Any:
    def answer(error: Exception) -> Response:
        if ENVIRON_KEY not in request.environ:
            raise error  # not a covered request: the app's own error handling decides
        # Never stored (the view raised: see _mark_raised_views), nor committed: the answer says
        # that nothing was, even where the key store keeps server errors.
        return _response(semantics.unavailable(middleware.store.retry_after))

    return answer
