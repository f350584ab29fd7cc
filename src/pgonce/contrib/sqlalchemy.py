"""SQLAlchemy 2.x sessions on psycopg 3: claims, outbox events and inbox handlers in the session's
transaction (the extra ``pgonce[sqlalchemy]``).

Everything here runs on the psycopg connection under the session, inside the session's
transaction, and never ends that transaction: the session's ``commit()`` commits the claim, the
ORM's writes, the stored response and the outbox rows together, and its ``rollback()`` (or an
exception leaving ``session.begin()``) frees the key with everything else.

- :func:`once` / :func:`async_once`: ``store.once()`` on a session; pending ORM writes are flushed
  before the claim completes, so they are part of the block.
- :func:`enqueue` / :func:`async_enqueue`: an outbox event in the session's transaction.
- :func:`inbox_handler`: an inbox worker handler that takes an ``AsyncSession`` bound to the
  event's transaction; :func:`process_batch`: a batch of inbox events whose handlers take a
  ``Session``, for sync code.
- :class:`EngineConnections` and :func:`idempotent_session`: the ASGI middleware on an
  ``AsyncEngine``'s pool, and an ``AsyncSession`` for the endpoint on the middleware's
  transaction (FastAPI).

Only the psycopg (v3) dialect is supported: a session on asyncpg, psycopg2 or pg8000 raises
:class:`NotPsycopgSession`, which names the URL scheme to use instead.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime, timedelta
from typing import Any
from weakref import WeakKeyDictionary

import psycopg

from pgonce.config import DEFAULT_SCHEMA
from pgonce.extras import needs

with needs("sqlalchemy", "pgonce.contrib.sqlalchemy"):
    import sqlalchemy.exc
    from sqlalchemy import event
    from sqlalchemy.dialects import registry
    from sqlalchemy.dialects.postgresql.psycopg import PGDialectAsync_psycopg
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
    from sqlalchemy.orm import Session
    from sqlalchemy.pool import NullPool
    from sqlalchemy.util import greenlet_spawn

try:  # only idempotent_session() needs it, and only an application on Starlette or FastAPI
    from starlette.requests import Request
except ModuleNotFoundError:  # pragma: no cover - the core and [sqlalchemy] without [asgi]
    Request = Any  # type: ignore[misc,assignment]
from pgonce.core.inbox import InboxEvent, OutOfOrderPolicy, RetryPolicy
from pgonce.errors import DatabaseUnavailable, UsageError
from pgonce.store._async.keys import AsyncKeyStore, AsyncOperation
from pgonce.store._async.outbox import enqueue as _async_enqueue
from pgonce.store._sync.inbox import InboxStore
from pgonce.store._sync.keys import KeyStore, Operation
from pgonce.store._sync.outbox import enqueue as _enqueue
from pgonce.webhooks.batch import DEFAULT_LIMIT, run_batch

__all__ = [
    "EngineConnections",
    "NotPsycopgSession",
    "SessionCommitRefused",
    "async_driver_connection",
    "async_enqueue",
    "async_once",
    "driver_connection",
    "enqueue",
    "idempotent_session",
    "inbox_handler",
    "once",
    "process_batch",
]


class NotPsycopgSession(UsageError):
    """The session's engine is not on the psycopg (v3) dialect."""

    def __init__(self, dialect: str) -> None:
        super().__init__(
            f"pgonce runs on psycopg 3, and the Session's engine uses {dialect}: create the "
            "engine with a postgresql+psycopg:// URL (create_engine and create_async_engine both "
            "take it)"
        )


class SessionCommitRefused(UsageError):
    """An endpoint committed the session that the idempotency middleware commits."""

    def __init__(self) -> None:
        super().__init__(
            "the endpoint's ORM unit of work runs in the idempotent request's transaction, which "
            "the middleware commits once the response is stored: call session.flush(), not "
            "session.commit()"
        )


def _dialect_name(dialect: Any) -> str:
    return f"{dialect.name}+{dialect.driver}"


def driver_connection(session: Session) -> psycopg.Connection[Any]:
    """The psycopg connection under ``session``, in the session's transaction.

    Raises :class:`NotPsycopgSession` for another driver.
    """
    driver, dialect = _driver(session)
    if not isinstance(driver, psycopg.Connection):
        raise NotPsycopgSession(_dialect_name(dialect))
    return driver


async def async_driver_connection(session: AsyncSession) -> psycopg.AsyncConnection[Any]:
    """The psycopg async connection under ``session``, in the session's transaction.

    Raises :class:`NotPsycopgSession` for another driver.
    """
    # One call in SQLAlchemy's greenlet (run_sync): session.connection() and
    # get_raw_connection() would start one each.
    driver, dialect = await session.run_sync(_driver)
    if not isinstance(driver, psycopg.AsyncConnection):
        raise NotPsycopgSession(_dialect_name(dialect))
    return driver


def _driver(session: Session) -> tuple[Any, Any]:
    """The driver's connection under ``session`` and the dialect it was reached through."""
    connection = session.connection()
    return connection.connection.driver_connection, connection.dialect


@contextmanager
def once(
    session: Session,
    scope: str,
    key: str,
    fingerprint: bytes,
    *,
    store: KeyStore | None = None,
    wait: timedelta | None = None,
    now: datetime | None = None,
) -> Iterator[Operation[Any]]:
    """``store.once()`` in the session's transaction (see :meth:`KeyStore.once`).

    ::

        with Session(engine) as session, session.begin():
            with once(session, "tenant-42", key, fp) as op:
                if op.won:
                    session.add(Order(...))
                    op.respond(Response(201, body=b"..."))
        # session.begin() committed the order, the claim and the response together

    The session's pending writes are flushed before the claim completes; an exception in the
    block rolls back the claim and the block's writes and propagates.
    """
    conn = driver_connection(session)
    with (store or KeyStore()).once(conn, scope, key, fingerprint, wait=wait, now=now) as op:
        yield op
        if op.won:
            session.flush()


@asynccontextmanager
async def async_once(
    session: AsyncSession,
    scope: str,
    key: str,
    fingerprint: bytes,
    *,
    store: AsyncKeyStore | None = None,
    wait: timedelta | None = None,
    now: datetime | None = None,
) -> AsyncIterator[AsyncOperation[Any]]:
    """:func:`once` for an ``AsyncSession``."""
    conn = await async_driver_connection(session)
    operation = (store or AsyncKeyStore()).once(conn, scope, key, fingerprint, wait=wait, now=now)
    async with operation as op:
        yield op
        if op.won:
            await session.flush()


def enqueue(
    session: Session,
    aggregatetype: str,
    aggregateid: str,
    type: str,
    payload: Any,
    *,
    headers: Mapping[str, str] | None = None,
    schema: str = DEFAULT_SCHEMA,
    now: datetime | None = None,
) -> int:
    """Write an outbox event in the session's transaction; its id (see ``store.outbox.enqueue``)."""
    return _enqueue(
        driver_connection(session),
        aggregatetype,
        aggregateid,
        type,
        payload,
        headers=headers,
        schema=schema,
        now=now,
    )


async def async_enqueue(
    session: AsyncSession,
    aggregatetype: str,
    aggregateid: str,
    type: str,
    payload: Any,
    *,
    headers: Mapping[str, str] | None = None,
    schema: str = DEFAULT_SCHEMA,
    now: datetime | None = None,
) -> int:
    """:func:`enqueue` for an ``AsyncSession``."""
    return await _async_enqueue(
        await async_driver_connection(session),
        aggregatetype,
        aggregateid,
        type,
        payload,
        headers=headers,
        schema=schema,
        now=now,
    )


# -- inbox handlers ---------------------------------------------------------------------------


class _BorrowedDialect(PGDialectAsync_psycopg):
    """The psycopg dialect on a connection that SQLAlchemy borrows and does not own.

    The inbox worker's connection is in the worker's transaction while a handler runs: SQLAlchemy
    must never commit, roll back or close it (its pool does that when a connection is returned),
    nor add a notice handler to it at every checkout. Savepoints, which the session uses for the
    handler's own part, are SQL statements and go through as usual.
    """

    supports_statement_cache = True

    @classmethod
    def get_async_dialect_cls(cls, url: Any) -> type[_BorrowedDialect]:
        return cls

    def on_connect(self) -> None:
        return None

    def do_commit(self, dbapi_connection: Any) -> None:
        pass

    def do_rollback(self, dbapi_connection: Any) -> None:
        pass

    def do_close(self, dbapi_connection: Any) -> None:
        pass

    def do_terminate(self, dbapi_connection: Any) -> None:
        pass


registry.register("postgresql.pgonce_borrowed", __name__, "_BorrowedDialect")

_borrowed: contextvars.ContextVar[psycopg.AsyncConnection[Any]] = contextvars.ContextVar(
    "pgonce_borrowed_connection"
)


async def _borrowed_connection() -> psycopg.AsyncConnection[Any]:
    return _borrowed.get()


InboxSessionHandler = Callable[[InboxEvent, AsyncSession], Awaitable[None]]


def inbox_handler(
    handler: InboxSessionHandler,
    *,
    session_factory: Callable[..., AsyncSession] = AsyncSession,
) -> Callable[[InboxEvent, psycopg.AsyncConnection[Any]], Awaitable[None]]:
    """An inbox worker handler that runs ``handler(event, session)`` in the event's transaction.

    The session is bound to the worker's connection, inside the worker's transaction, with a
    savepoint of its own (``join_transaction_mode="create_savepoint"``): the handler's ORM
    writes commit when the worker marks the event done, together, or not at all. A
    ``session.commit()`` in the handler releases that savepoint (its writes still commit with the
    event), a ``session.rollback()`` undoes only the handler's writes; neither ends the worker's
    transaction. An exception rolls back the handler's writes and reaches the worker, which
    records the failure. ``session_factory`` makes the session (e.g. an ``async_sessionmaker``
    for the application's session options); it is called with ``bind`` and
    ``join_transaction_mode``.
    """
    engine: AsyncEngine | None = None

    async def run(event: InboxEvent, conn: psycopg.AsyncConnection[Any]) -> None:
        nonlocal engine
        if engine is None:
            engine = create_async_engine(
                "postgresql+pgonce_borrowed://",
                async_creator=_borrowed_connection,
                poolclass=NullPool,
                pool_reset_on_return=None,
            )
        token = _borrowed.set(conn)
        try:
            async with engine.connect() as bound:
                await bound.begin()  # SQLAlchemy's view of the worker's transaction; no SQL
                session = session_factory(bind=bound, join_transaction_mode="create_savepoint")
                async with session:
                    try:
                        await handler(event, session)
                        await session.commit()  # releases the handler's savepoint
                    except BaseException:
                        await session.rollback()
                        raise
        finally:
            _borrowed.reset(token)

    return run


#: A handler for :func:`process_batch`: the event (``payload`` parsed when the body is JSON) and a
#: ``Session`` in the event's savepoint.
SessionHandler = Callable[[InboxEvent, Session], None]


def process_batch(
    engine: Engine,
    source: str,
    handler: SessionHandler,
    *,
    session_factory: Callable[..., Session] = Session,
    limit: int = DEFAULT_LIMIT,
    retry: RetryPolicy | None = None,
    out_of_order: OutOfOrderPolicy = "process",
    schema: str = DEFAULT_SCHEMA,
    now: datetime | None = None,
) -> int:
    """Claim up to ``limit`` pending events of ``source`` and run ``handler(event, session)`` on
    each, in one transaction on a connection of ``engine``; returns how many were claimed.

    The sync counterpart of :func:`inbox_handler`, for code that writes through a ``Session``:
    the batch runs in a transaction of its own (the claim marks the events done), each handler
    gets a ``Session`` bound to that transaction in a savepoint of its own, and the batch commits
    when the last handler returned. A handler that raises has its savepoint rolled back and its
    failure recorded (retry after the ``retry`` policy's backoff, then dead letter); the other
    events commit. As with :func:`inbox_handler`, ``session.commit()`` in a handler only
    releases its savepoint and ``session.rollback()`` undoes only its writes. ``session_factory``
    (a ``sessionmaker``) makes the sessions; it is called with ``bind`` and
    ``join_transaction_mode``. ``out_of_order="drop"``, ``now`` and the rest are
    :func:`pgonce.webhooks.batch.run_batch`'s.

    Call it in a loop (``while process_batch(...): pass``) from a script, a management command
    or a periodic task; several processes may run it at once (``FOR UPDATE SKIP LOCKED``).
    """
    if not isinstance(engine, Engine):
        raise UsageError(
            "process_batch() takes a SQLAlchemy Engine (create_engine()), not "
            f"{type(engine).__qualname__}: an AsyncEngine's handlers run in the async inbox "
            "worker, through inbox_handler()"
        )
    if engine.dialect.driver != "psycopg":
        raise NotPsycopgSession(_dialect_name(engine.dialect))
    store = InboxStore(schema=schema)
    try:
        connected = engine.connect()
    except (sqlalchemy.exc.DBAPIError, sqlalchemy.exc.TimeoutError) as error:
        raise DatabaseUnavailable(f"connecting through the engine failed: {error}") from error
    with connected as bound, bound.begin():
        conn = bound.connection.driver_connection
        if not isinstance(conn, psycopg.Connection):  # a custom creator's
            raise NotPsycopgSession(_dialect_name(engine.dialect))

        @contextmanager
        def savepoint() -> Iterator[Session]:
            with session_factory(bind=bound, join_transaction_mode="create_savepoint") as session:
                session.connection()  # the SAVEPOINT now: a watermark's move happens inside it
                try:
                    yield session
                    session.commit()  # flushes, and releases the savepoint
                except BaseException:
                    session.rollback()
                    raise

        return run_batch(
            conn,
            source,
            handler,
            savepoint,
            store=store,
            limit=limit,
            retry=retry,
            out_of_order=out_of_order,
            now=now,
        )


# -- the HTTP path ----------------------------------------------------------------------------

# The SQLAlchemy connection under each psycopg connection that EngineConnections handed out.
_checked_out: WeakKeyDictionary[psycopg.AsyncConnection[Any], SAAsyncConnection] = (
    WeakKeyDictionary()
)


class EngineConnections:
    """The ASGI middleware's connections, from a SQLAlchemy ``AsyncEngine``'s pool.

    Pass it as the middleware's ``pool``: ``IdempotencyMiddleware(app, pool=EngineConnections(
    engine), ...)``. The middleware owns the transaction on the connection (BEGIN and the claim,
    then the completion and COMMIT); :func:`idempotent_session` gives the endpoint an
    ``AsyncSession`` on that same connection and transaction. The engine must be on
    ``postgresql+psycopg://``.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        if not isinstance(engine, AsyncEngine):
            raise UsageError("EngineConnections takes a SQLAlchemy AsyncEngine")
        dialect = engine.dialect
        if dialect.driver not in ("psycopg", "psycopg_async"):
            raise NotPsycopgSession(_dialect_name(dialect))
        self.engine = engine

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        try:
            sync, conn = await greenlet_spawn(_open, self.engine.sync_engine)
        except (sqlalchemy.exc.DBAPIError, sqlalchemy.exc.TimeoutError) as error:
            raise DatabaseUnavailable(f"connecting through the engine failed: {error}") from error
        bound = SAAsyncConnection(self.engine, sync)
        try:
            if not isinstance(conn, psycopg.AsyncConnection):
                raise NotPsycopgSession(_dialect_name(bound.dialect))
            _checked_out[conn] = bound
            try:
                yield conn
            finally:
                _checked_out.pop(conn, None)
        finally:
            await bound.close()


def _open(engine: Engine) -> tuple[Connection, Any]:
    """A connection from ``engine``'s pool, the driver's connection under it, and SQLAlchemy's
    view of the transaction the middleware opens begun on it.

    No SQL is sent (psycopg opens transactions itself). A session joining it never commits it
    (see idempotent_session); when the connection goes back to the pool, the middleware has ended
    the transaction, and SQLAlchemy's rollback finds nothing to do. One call in SQLAlchemy's
    greenlet for the three: ``AsyncEngine.connect()``, ``get_raw_connection()`` and ``begin()``
    would start one each.
    """
    connection = engine.connect()
    try:
        driver = connection.connection.driver_connection
        connection.begin()
    except BaseException:
        connection.close()
        raise
    return connection, driver


def _refuse_commit(session: Session) -> None:
    raise SessionCommitRefused()


class _RequestSession(Session):
    """The sync side of an endpoint's session: its commit is refused (:func:`idempotent_session`).

    The listener is on the class, once, not on each request's session: registering one on an
    instance costs more than the rest of handing out the session.
    """


event.listen(_RequestSession, "before_commit", _refuse_commit)


async def idempotent_session(request: Request) -> AsyncIterator[AsyncSession]:
    """FastAPI dependency: an ``AsyncSession`` on the idempotent request's transaction.

    ::

        Session = Annotated[AsyncSession, Depends(idempotent_session, scope="function")]

        @app.post("/payments")
        async def create(body: Payment, session: Session):
            session.add(PaymentRow(...))
            await session.flush()

    ``scope="function"`` ends the dependency (its final flush) before the response leaves the
    endpoint, so a write that fails there fails the request instead of following its answer.
    The session writes on the connection where the middleware claimed the key, so the ORM's
    writes, the claim and the stored response commit together, after the response is stored.
    ``session.commit()`` raises :class:`SessionCommitRefused` (it would commit before the
    response is stored): flush instead. Asking for the session marks the endpoint as begun, so
    its response is stored. Needs the middleware on :class:`EngineConnections`.
    """
    # Imported here: the sync parts of this module (used by WSGI apps) need no ASGI library.
    from pgonce.http.transaction import transaction_of

    tx = transaction_of(request)
    bound = _checked_out.get(tx.connection)
    if bound is None:
        raise UsageError(
            "idempotent_session needs the idempotency middleware on EngineConnections(engine): "
            "this request's connection did not come from a SQLAlchemy engine"
        )
    session = AsyncSession(
        bind=bound, join_transaction_mode="rollback_only", sync_session_class=_RequestSession
    )
    try:
        yield session
    except BaseException:
        await session.close()
        raise
    # The last flush and the close in one call in SQLAlchemy's greenlet (each would start one).
    await session.run_sync(_flush_and_close)


def _flush_and_close(session: Session) -> None:
    try:
        session.flush()  # returns at once when there is nothing to write
    finally:
        session.close()
