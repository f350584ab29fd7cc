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
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import psycopg

from pgonce.config import DEFAULT_SCHEMA
from pgonce.errors import UsageError
from pgonce.http.semantics import NO_WAIT
from pgonce.store._async.keys import AsyncKeyStore
from pgonce.store._async.phases import AsyncPhaseStore
from pgonce.store._sync.keys import KeyStore
from pgonce.store._sync.phases import PhaseStore
from pgonce.store.common import check_schema, check_wait

__all__ = ["SCHEMA_NOT_GIVEN", "middleware_pool", "middleware_stores"]


class _DefaultSchema(str):
    """pgonce's default schema name, told apart (by identity) from the same name given."""

    __slots__ = ()


#: The default of a middleware's ``schema``: pgonce's default schema, unless a given store names
#: another. ``schema="pgonce"`` given explicitly is not this, and must agree with the store.
SCHEMA_NOT_GIVEN: str = _DefaultSchema(DEFAULT_SCHEMA)

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


def _check_pool(pool: object, *, asynchronous: bool) -> bool:
    """Refuse a pool without ``connection()``, or one whose ``connection()`` is of the other
    kind (a sync pool given to the ASGI middleware, an async one to the WSGI middleware), or an
    ``async def`` (which returns a coroutine, never a context manager), which the first request
    would find as a ``TypeError`` from ``with`` or ``async with``. Whether the kind of what
    ``connection()`` returns was told (a ``contextmanager`` or ``asynccontextmanager``): a plain
    ``def`` only says it when called."""
    connection = getattr(pool, "connection", None)
    if callable(connection):
        made = inspect.unwrap(connection)  # a contextmanager's or asynccontextmanager's function
        if inspect.iscoroutinefunction(connection) or inspect.iscoroutinefunction(made):
            wrong = True
        elif asynchronous:
            wrong = inspect.isgeneratorfunction(made)
        else:
            wrong = inspect.isasyncgenfunction(made)
        if not wrong:
            told = inspect.isasyncgenfunction if asynchronous else inspect.isgeneratorfunction
            return told(made)
    if asynchronous:
        wanted = "psycopg_pool.AsyncConnectionPool (or have an async connection())"
    else:
        wanted = "psycopg_pool.ConnectionPool (or have a sync connection())"
    raise UsageError(f"pool must be a {wanted}, not {type(pool).__name__}")


def middleware_pool(pool: Any, *, asynchronous: bool) -> Any:
    """``pool``, refused as :func:`middleware_stores` refuses it (the webhook receiver's too),
    or, when its ``connection()`` is a plain ``def`` whose result only a call can tell, ``pool``
    behind a check of that result: a ``connection()`` that returns the wrong kind of context
    manager (a sync one to the ASGI middleware, an async one to the WSGI middleware) or none (a
    bare connection, which ``with`` would close) is a :class:`~pgonce.errors.UsageError` naming
    it at the request, not a ``TypeError`` from ``with``, nor a connection closed behind the
    pool's back."""
    if _check_pool(pool, asynchronous=asynchronous):
        return pool
    return _CheckedAsyncSource(pool) if asynchronous else _CheckedSource(pool)


def _wrong_lender(pool: object, lent: object, *, asynchronous: bool) -> UsageError:
    owner = f"{type(pool).__name__}.connection()"
    if isinstance(lent, psycopg.Connection | psycopg.AsyncConnection):
        what = "a connection, not a context manager that lends one"
    else:
        what = f"{type(lent).__name__}, not an {'async ' if asynchronous else ''}context manager"
    kind = "ASGI" if asynchronous else "WSGI"
    use = "async with" if asynchronous else "with"
    return UsageError(
        f"{owner} returned {what}: the {kind} middleware takes each request's connection with "
        f"`{use} pool.connection() as conn`, as psycopg_pool's "
        f"{'Async' if asynchronous else ''}ConnectionPool lends it"
    )


class _CheckedSource:
    """A sync pool whose ``connection()`` is a plain ``def``: its result checked at each call."""

    __slots__ = ("pool",)

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        lent = self.pool.connection()
        if isinstance(lent, psycopg.Connection | psycopg.AsyncConnection) or not (
            hasattr(lent, "__enter__") and hasattr(lent, "__exit__")
        ):
            raise _wrong_lender(self.pool, lent, asynchronous=False)
        with lent as conn:
            yield conn


class _CheckedAsyncSource:
    """An async pool whose ``connection()`` is a plain ``def``: its result checked at each
    call."""

    __slots__ = ("pool",)

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        lent = self.pool.connection()
        if isinstance(lent, psycopg.Connection | psycopg.AsyncConnection) or not (
            hasattr(lent, "__aenter__") and hasattr(lent, "__aexit__")
        ):
            if inspect.iscoroutine(lent):
                lent.close()  # never awaited: no warning besides the error
            raise _wrong_lender(self.pool, lent, asynchronous=True)
        async with lent as conn:
            yield conn


def _schema_of(store: Any, phases: Any, schema: str) -> str:
    """The one schema the given stores and ``schema`` name (``schema`` left at its default,
    :data:`SCHEMA_NOT_GIVEN`, names none; the same name given explicitly does): the two-phase
    store is built on the key store's schema, and the other way round."""
    # The stores were checked to be pgonce's, which all have a schema.
    named: dict[str, str] = {
        what: given.schema
        for what, given in (("store", store), ("phases", phases))
        if given is not None
    }
    if schema is not SCHEMA_NOT_GIVEN:
        named["schema"] = check_schema(schema)
    if len(set(named.values())) > 1:
        each = ", ".join(f"{what}={name!r}" for what, name in named.items())
        raise UsageError(
            f"store, phases and schema name different schemas ({each}): the key store and the "
            "two-phase store of a middleware must be on one schema, where pgonce's tables are "
            "(leave schema out to use the given store's)"
        )
    return next(iter(named.values()), DEFAULT_SCHEMA)
