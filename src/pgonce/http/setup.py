"""The set-up checks the ASGI and the WSGI middlewares share, written once.

Each middleware takes the same arguments beside its rules (:class:`~pgonce.http.semantics.
IdempotencyRules`, which checks its own): the application, the key scope, the pool, the stores
and the wait. A misuse of one of them is refused here, when the middleware is built, with the same
:class:`~pgonce.errors.UsageError` whichever middleware it is given to, never found out at the
first request as a 500 or a late ``TypeError``. What differs between the two is only which kind
(async or sync) of pool, stores and key scope each one takes.
"""

from __future__ import annotations

import inspect
from typing import Any

from pgonce.config import DEFAULT_SCHEMA
from pgonce.errors import UsageError
from pgonce.store.common import check_wait

__all__ = ["check_middleware"]


def check_middleware(
    *,
    asynchronous: bool,
    app: object,
    key_scope: object,
    pool: object,
    store: object,
    phases: object,
    key_store: type,
    phase_store: type,
    wait: object,
    schema: str,
) -> str:
    """Refuse what a middleware (the ASGI one when ``asynchronous``, else the WSGI one) cannot
    use; the schema of the stores it builds: the one its given ``store`` or ``phases`` is on,
    else ``schema``.

    ``key_store`` and ``phase_store`` are the store classes of the middleware's kind.
    """
    kind = "ASGI" if asynchronous else "WSGI"
    if not callable(app):
        raise UsageError(
            f"IdempotencyMiddleware wraps a{'n' if asynchronous else ''} {kind} "
            "application (a callable)"
        )
    if not callable(key_scope):
        of = "ASGI scope" if asynchronous else "WSGI environ"
        raise UsageError(f"key_scope must be a function of the {of}")
    if not asynchronous and inspect.iscoroutinefunction(key_scope):
        # Called and never awaited: every covered request would fail on the coroutine.
        raise UsageError(
            "key_scope must be a plain function (def), not async def: the WSGI middleware "
            "calls it and does not await it"
        )
    _check_pool(pool, asynchronous=asynchronous)
    for what, given, wanted in (("store", store, key_store), ("phases", phases, phase_store)):
        if given is not None and not isinstance(given, wanted):
            which = "" if asynchronous else " (the sync one)"
            raise UsageError(
                f"{what} must be a pgonce {wanted.__name__}{which}, not {type(given).__name__}"
            )
    if wait is not None:
        # Checked by the stores the middleware builds, but not when both are given, while the
        # claim and a two-phase duplicate's wait still use it.
        check_wait(wait)
    return _schema_of(store, phases, schema)


def _check_pool(pool: object, *, asynchronous: bool) -> None:
    """Refuse a pool without ``connection()``, or one whose ``connection()`` is of the other
    kind (a sync pool given to the ASGI middleware, an async one to the WSGI middleware), which
    the first request would find as a ``TypeError`` from ``with`` or ``async with``."""
    connection = getattr(pool, "connection", None)
    if callable(connection):
        made = inspect.unwrap(connection)  # a contextmanager's or asynccontextmanager's function
        if asynchronous:
            wrong = inspect.isgeneratorfunction(made)
        else:
            wrong = inspect.isasyncgenfunction(made) or inspect.iscoroutinefunction(made)
        if not wrong:
            return
    if asynchronous:
        wanted = "psycopg_pool.AsyncConnectionPool (or have an async connection())"
    else:
        wanted = "psycopg_pool.ConnectionPool (or have a sync connection())"
    raise UsageError(f"pool must be a {wanted}, not {type(pool).__name__}")


def _schema_of(store: Any, phases: Any, schema: str) -> str:
    """The one schema the given stores and ``schema`` name (``schema`` left at its default names
    none): the two-phase store is built on the key store's schema, and the other way round."""
    # The stores were checked to be pgonce's, which all have a schema.
    named: set[str] = {given.schema for given in (store, phases) if given is not None}
    if schema != DEFAULT_SCHEMA:
        named.add(schema)
    if len(named) > 1:
        raise UsageError(
            "store, phases and schema name different schemas "
            f"({', '.join(sorted(map(repr, named)))}): the key store and the two-phase store "
            "of a middleware must be on one schema, where pgonce's tables are"
        )
    return named.pop() if named else schema
