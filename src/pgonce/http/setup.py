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
from datetime import timedelta
from typing import Any, TypeVar

from pgonce.config import DEFAULT_SCHEMA
from pgonce.errors import UsageError
from pgonce.http.semantics import NO_WAIT
from pgonce.store._async.keys import AsyncKeyStore
from pgonce.store._async.phases import AsyncPhaseStore
from pgonce.store._sync.keys import KeyStore
from pgonce.store._sync.phases import PhaseStore
from pgonce.store.common import check_wait

__all__ = ["middleware_stores"]

K = TypeVar("K", AsyncKeyStore, KeyStore)
P = TypeVar("P", AsyncPhaseStore, PhaseStore)


def middleware_stores(
    *,
    asynchronous: bool,
    app: object,
    key_scope: object,
    pool: object,
    store: K | None,
    phases: P | None,
    key_store: type[K],
    phase_store: type[P],
    wait: timedelta | None,
    schema: str,
) -> tuple[K, P]:
    """Refuse what a middleware (the ASGI one when ``asynchronous``, else the WSGI one) cannot
    use; its key store and two-phase store: those given, else built on the schema of the one
    given (or ``schema``) with ``wait`` (:data:`~pgonce.http.semantics.NO_WAIT` for ``None``),
    the two-phase one with the key store's settings.

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
    schema = _schema_of(store, phases, schema)
    claim_wait = wait if wait is not None else NO_WAIT
    key = store or key_store(schema=schema, wait=claim_wait)
    two_phase = phases or phase_store(
        schema=schema,
        wait=claim_wait,
        retry_after=key.retry_after,
        store_server_errors=key.store_server_errors,
    )
    return key, two_phase


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
