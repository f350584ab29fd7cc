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
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import timedelta
from typing import Any

import psycopg

from pgonce.config import DEFAULT_SCHEMA
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
from pgonce.store._sync.keys import KeyStore

with needs("flask", "the Flask Idempotency-Key integration"):
    from flask import Flask, Response, has_request_context, request
    from psycopg_pool import ConnectionPool

__all__ = ["Idempotency", "connection", "header_scope", "transaction"]


def transaction() -> IdempotentTransaction:
    """The current request's :class:`~pgonce.contrib.wsgi.IdempotentTransaction`.

    Raises :class:`UsageError` outside a request or on a request the middleware claimed no key
    for, and :class:`MissingKeyScope` (answered 401) when the key scope named no caller.
    """
    if not has_request_context():
        raise UsageError("pgonce.contrib.flask.transaction() is for use inside a Flask request")
    return transaction_of(request.environ)


def connection() -> psycopg.Connection[Any]:
    """The claim's connection, inside its transaction: write on it and the writes commit with the
    key and the stored response. Call it in the view (it marks the view as begun); never commit
    or roll back on it."""
    return transaction().connection


class Idempotency:
    """The Flask extension: ``Idempotency(app, pool=..., key_scope=...)`` or ``init_app()``.

    The options are :class:`~pgonce.contrib.wsgi.IdempotencyMiddleware`'s; ``key_scope`` is a
    function of the WSGI environ (it runs before Flask's request context exists).
    """

    def __init__(self, app: Flask | None = None, **options: Any) -> None:
        self.middleware: IdempotencyMiddleware | None = None
        if app is not None:
            self.init_app(app, **options)

    def init_app(
        self,
        app: Flask,
        *,
        pool: ConnectionPool[Any] | ConnectionSource,
        key_scope: KeyScope,
        store: KeyStore | None = None,
        schema: str = DEFAULT_SCHEMA,
        methods: Collection[str] = DEFAULT_METHODS,
        routes: Mapping[str, Collection[str]] | None = None,
        require_key: bool = True,
        wait: timedelta | None = None,
        canonicalize_json: bool = True,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        retention: timedelta = DEFAULT_RETENTION,
    ) -> IdempotencyMiddleware:
        if not isinstance(app, Flask):
            raise UsageError(f"Idempotency needs a Flask app, not {type(app).__name__}")
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
        )
        app.wsgi_app = middleware  # type: ignore[method-assign]
        app.extensions["pgonce"] = self
        app.register_error_handler(MissingKeyScope, _missing_scope)
        app.register_error_handler(psycopg.OperationalError, _unavailable(middleware))
        app.register_error_handler(DatabaseUnavailable, _unavailable(middleware))
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


def _unavailable(middleware: IdempotencyMiddleware) -> Any:
    def answer(error: Exception) -> Response:
        if ENVIRON_KEY not in request.environ:
            raise error  # not a covered request: the app's own error handling decides
        return _response(semantics.unavailable(middleware.store.retry_after))

    return answer
