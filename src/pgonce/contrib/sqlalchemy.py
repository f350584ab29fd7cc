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
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg

from pgonce.config import DEFAULT_SCHEMA
from pgonce.extras import needs

with needs("sqlalchemy", "pgonce.contrib.sqlalchemy"):
    import sqlalchemy.exc
    from sqlalchemy import event
    from sqlalchemy.dialects import registry
    from sqlalchemy.dialects.postgresql.psycopg import PGDialectAsync_psycopg
    from sqlalchemy.engine import Connection, Engine, RootTransaction, Transaction
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import (
        AsyncEngine,
        AsyncSession,
        async_scoped_session,
        create_async_engine,
    )
    from sqlalchemy.orm import Session, SessionTransaction, scoped_session
    from sqlalchemy.pool import NullPool
    from sqlalchemy.util import greenlet_spawn

try:  # only idempotent_session() needs it, and only an application on Starlette or FastAPI
    from starlette.requests import Request
except ModuleNotFoundError:  # pragma: no cover - the core and [sqlalchemy] without [asgi]
    Request = Any  # type: ignore[misc,assignment]
from pgonce.core.inbox import InboxEvent, OutOfOrderPolicy, RetryPolicy
from pgonce.core.outbox import event_row, type_name
from pgonce.errors import DatabaseUnavailable, NotInTransaction, PgonceError, UsageError
from pgonce.store._async.keys import AsyncKeyStore, AsyncOperation
from pgonce.store._async.outbox import enqueue_row as async_enqueue_row
from pgonce.store._sync.inbox import InboxStore
from pgonce.store._sync.keys import KeyStore, Operation
from pgonce.store._sync.outbox import enqueue_row
from pgonce.store.common import require_transaction
from pgonce.store.errors import translate_errors
from pgonce.webhooks.batch import DEFAULT_LIMIT, run_batch

if TYPE_CHECKING:
    from pgonce.http.transaction import IdempotentTransaction

__all__ = [
    "BlockCommitRefused",
    "EngineConnections",
    "NotPsycopgSession",
    "SessionCommitRefused",
    "SessionRollbackRefused",
    "TransactionEndRefused",
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


class SessionRollbackRefused(UsageError):
    """An endpoint rolled back the session whose transaction holds the request's claim."""

    def __init__(self) -> None:
        super().__init__(
            "the endpoint's ORM unit of work runs in the idempotent request's transaction, and "
            "session.rollback() would roll back its claim too: undo a part with a savepoint "
            "(async with session.begin_nested(): ...), or raise (or answer a 5xx) to roll back "
            "the whole request"
        )


class TransactionEndRefused(UsageError):
    """A handler committed or rolled back the connection of the transaction it runs in."""

    def __init__(self, action: str) -> None:
        super().__init__(
            "an inbox handler runs in the batch's transaction, which the inbox worker (or "
            f"process_batch()) commits once every handler returned: the connection's {action}() "
            "would end it for the other events too. Call session.flush() (or session.commit(), "
            "which releases the handler's savepoint), and raise to undo the handler's writes"
        )


class BlockCommitRefused(UsageError):
    """A ``commit()`` of the session (or of its connection) inside a :func:`once` block."""

    def __init__(self) -> None:
        super().__init__(
            "commit() inside once()'s block (or async_once()'s) would commit the claim before "
            "its response is stored, and the block's later writes would run without it: write "
            "with session.add() or session.flush() in the block (its end flushes), and commit "
            "the session after the block"
        )


def _dialect_name(dialect: Any) -> str:
    return f"{dialect.name}+{dialect.driver}"


def driver_connection(session: Session) -> psycopg.Connection[Any]:
    """The psycopg connection under ``session``, in the session's transaction.

    Raises :class:`NotPsycopgSession` for another driver, :class:`~pgonce.errors.UsageError` for
    something that is not a ``Session``.
    """
    if not isinstance(session, Session):
        if not isinstance(session, scoped_session):
            raise _not_a(session, "a SQLAlchemy Session", "async_once() and async_enqueue()")
        session = session()  # the registry's session for this scope
    driver, dialect = _driver(session, False)
    if not isinstance(driver, psycopg.Connection):
        if isinstance(driver, psycopg.AsyncConnection):  # a custom creator's
            raise _async_engine()
        raise NotPsycopgSession(_dialect_name(dialect))
    return driver


def _async_engine() -> UsageError:
    return UsageError(
        "this Session runs on an async engine (the sync side of an AsyncSession, as in "
        "run_sync(), or create_engine() on postgresql+psycopg_async://): call async_once() or "
        "async_enqueue() with the AsyncSession, or give the Session an engine of "
        "create_engine('postgresql+psycopg://...')"
    )


async def async_driver_connection(session: AsyncSession) -> psycopg.AsyncConnection[Any]:
    """The psycopg async connection under ``session``, in the session's transaction.

    Raises :class:`NotPsycopgSession` for another driver, :class:`~pgonce.errors.UsageError` for
    something that is not an ``AsyncSession``.
    """
    if not isinstance(session, AsyncSession):
        if not isinstance(session, async_scoped_session):
            raise _not_a(session, "a SQLAlchemy AsyncSession", "once() and enqueue()")
        session = session()
    # One call in SQLAlchemy's greenlet (run_sync): session.connection() and
    # get_raw_connection() would start one each.
    driver, dialect = await session.run_sync(_driver, True)
    if not isinstance(driver, psycopg.AsyncConnection):
        raise NotPsycopgSession(_dialect_name(dialect))
    return driver


def _not_a(value: object, expected: str, instead: str) -> UsageError:
    if isinstance(value, AsyncSession | Session):  # the other kind of session
        return UsageError(f"expected {expected}, not {type_name(value)}: use {instead}")
    return UsageError(
        f"expected {expected}, not {type_name(value)}: pass the session the ORM writes through "
        "(Session(engine) / AsyncSession(engine), or a sessionmaker's), not an engine or a "
        "connection"
    )


def _driver(session: Session, in_async: bool) -> tuple[Any, Any]:
    """The driver's connection under ``session`` and the dialect it was reached through.

    Another driver, or a sync Session on an engine of the async dialect, is refused
    before connecting: connecting through asyncpg outside SQLAlchemy's greenlet raises
    ``MissingGreenlet``, and asyncpg's own connection errors are bare OSErrors.
    """
    try:
        dialect = session.get_bind().dialect
    except sqlalchemy.exc.UnboundExecutionError as error:
        if getattr(session, "binds", None):  # binds= per mapper or table only
            raise UsageError(
                "the session has engines per mapper or table (binds=) and none of its own, and "
                "pgonce's claim, outbox row and stored response must run on the connection "
                "where the ORM's writes commit: give the session that engine as bind= too "
                "(Session(bind=engine, binds=...)); writes through another engine commit in "
                "another transaction, apart from the claim"
            ) from error
        raise UsageError(
            "the session is bound to no engine: create it with one (Session(engine), "
            "AsyncSession(engine), or a sessionmaker(engine)'s)"
        ) from error
    if dialect.driver != "psycopg":
        raise NotPsycopgSession(_dialect_name(dialect))
    if dialect.is_async and not in_async:
        raise _async_engine()
    try:
        connection = session.connection()
    except _CONNECT_FAILED as error:
        raise DatabaseUnavailable(f"connecting through the session failed: {error}") from error
    except sqlalchemy.exc.PendingRollbackError as error:
        # A flush failed and SQLAlchemy rolled the transaction back; the session waits for its
        # owner's rollback(). The core store says a failed transaction so too.
        raise UsageError(_FAILED_TRANSACTION) from error
    except sqlalchemy.exc.InvalidRequestError as error:
        if session.in_transaction():  # a transaction in another state SQLAlchemy refuses
            raise
        # Session(autobegin=False) outside its begin(): a write there would have no
        # transaction to commit with.
        raise NotInTransaction(
            "pgonce writes in the Session's transaction, and this Session has autobegin=False "
            "and no transaction begun: call it inside session.begin() (with session.begin(): "
            "..., or async with session.begin(): ... for an AsyncSession)"
        ) from error
    return connection.connection.driver_connection, connection.dialect


# What a call on a session whose transaction has failed is told (the core store's words for a
# connection's).
_FAILED_TRANSACTION = (
    "the session's transaction has failed (a flush or statement before this call raised): roll "
    "it back (session.rollback(), or leave its session.begin() block), which also frees any key "
    "it claimed, and call again in a new one"
)


def _lost(error: sqlalchemy.exc.DBAPIError) -> bool:
    """Whether SQLAlchemy's ``error`` is psycopg's loss of the connection (or another
    OperationalError, which the core store says as DatabaseUnavailable too, or a savepoint
    that is gone: nothing is left to roll back to either way)."""
    return error.connection_invalidated or isinstance(error.orig, psycopg.OperationalError)


class _translated(translate_errors):
    """Re-raise SQLAlchemy's error in a statement that pgonce sends through the session (a
    flush it asks for, a savepoint's end) as the core store says psycopg's error under it,
    naming ``what`` failed, when psycopg's is an OperationalError: a lost connection as
    :class:`~pgonce.errors.DatabaseUnavailable`, a savepoint that is gone (ended by the caller's
    code inside the block) as :class:`~pgonce.errors.UsageError`. SQLAlchemy's error is the
    ``__cause__``. Other errors (the caller's writes' own: an IntegrityError) are raised as they
    are."""

    __slots__ = ()

    def said(self, error: BaseException) -> PgonceError | None:
        if not isinstance(error, sqlalchemy.exc.DBAPIError):
            return None
        cause = error.orig
        if isinstance(cause, psycopg.OperationalError):
            return super().said(cause)
        if error.connection_invalidated:
            return self.unavailable(cause if cause is not None else error)
        return None


class _translated_own(_translated):
    """:class:`_translated` for a statement of pgonce's own (once()'s SAVEPOINT, RELEASE or
    ROLLBACK TO), whose every database error the core store says in its words: a
    ``DatabaseError`` for a transaction that failed inside the block, as the core's
    completion there says it."""

    __slots__ = ()

    def said(self, error: BaseException) -> PgonceError | None:
        if (
            isinstance(error, sqlalchemy.exc.DBAPIError)
            and isinstance(error.orig, psycopg.Error)
            and not error.connection_invalidated
        ):
            return translate_errors.said(self, error.orig)
        return super().said(error)


class _translated_writes(_translated):
    """:class:`_translated` for the caller's writes that pgonce flushes or commits (once()'s
    block and an inbox handler at their end, process_batch()'s transaction): only the loss of
    the connection is said as pgonce's
    :class:`~pgonce.errors.DatabaseUnavailable`. What PostgreSQL refuses in a write (a lock
    timeout, a deadlock, a serialization failure: OperationalErrors to psycopg too) is raised as
    SQLAlchemy raises it when the caller flushes the same write inside the block, as the core
    store raises its caller's writes' own errors."""

    __slots__ = ()

    def said(self, error: BaseException) -> PgonceError | None:
        if isinstance(error, sqlalchemy.exc.DBAPIError) and error.connection_invalidated:
            return self.unavailable(error.orig if error.orig is not None else error)
        return None


_Store = TypeVar("_Store", KeyStore, AsyncKeyStore)

# Module constants: an enum class's attribute lookup at each use otherwise.
_IDLE = psycopg.pq.TransactionStatus.IDLE
_INERROR = psycopg.pq.TransactionStatus.INERROR

# What SQLAlchemy raises when its pool cannot hand out a connection.
_CONNECT_FAILED = (sqlalchemy.exc.DBAPIError, sqlalchemy.exc.TimeoutError)


def _checked_store(store: object, kind: type[_Store]) -> _Store:
    """``store``, a new ``kind`` for None, or a :class:`~pgonce.errors.UsageError` naming it."""
    if store is None:
        return kind()
    if not isinstance(store, kind):
        raise UsageError(f"store must be a {kind.__qualname__}, not {type_name(store)}")
    return store


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

    The block is a savepoint of the session's (``session.begin_nested()``): the session's
    earlier writes are flushed before it, the block's writes are flushed before the claim
    completes, and an exception in the block (or a 5xx that is not stored) rolls back the claim
    with the block's writes, in the database and in the session alike (what the block added is
    expunged), and propagates; the session's transaction goes on. Inside the block,
    ``session.commit()``, ``session.connection().commit()`` and the psycopg connection's
    ``commit()`` raise :class:`BlockCommitRefused` and commit nothing: they would commit the claim
    before its response is stored. A transaction ended in SQL inside the block (or by a
    ``commit()`` pgonce cannot refuse: ``psycopg.Connection.commit(conn)``, a bound method taken
    before the block) is settled as :meth:`KeyStore.once` settles it (with a
    :class:`~pgonce.errors.UsageError`), and the session's transaction rolled back; when ORM
    objects of the block were still unflushed at that end, they were never written and nothing
    is stored (a committed claim stays in flight). The error names the outbox events the block
    enqueued, which such a commit commits with the claim. A
    ``session.begin_nested()`` begun in the block ends in it (one still open at the block's end is
    refused with a :class:`~pgonce.errors.UsageError`, and the block rolled back).
    """
    keys = _checked_store(store, KeyStore)
    if isinstance(session, scoped_session):
        session = session()
    conn = driver_connection(session)
    operation = keys.once(conn, scope, key, fingerprint, wait=wait, now=now)
    nested, held = _open_block(session, conn)
    try:
        try:
            op = operation.__enter__()
        except BaseException:
            _leave(nested, conn)
            raise
        try:
            yield op
            ended = _finish(session, nested, op.won, conn)
            if ended and op.won:
                _refuse_unwritten(session)
        except BaseException as error:
            # A failed flush has rolled back the session's savepoint, pgonce's inside it: then
            # pgonce's ROLLBACK TO would fail, and leave the caller's transaction aborted.
            if nested.is_active:
                operation.__exit__(type(error), error, error.__traceback__)
            if (told := _left(error, nested, conn, None)) is None:
                raise
            raise told from error
        try:
            operation.__exit__(None, None, None)
        except BaseException as error:
            if (told := _left(error, nested, conn, op.stored if ended else None)) is None:
                raise
            raise told from error
        _close_block(nested, conn, ended, op.won and not op.stored)
    finally:
        held.release()
        _forget_events(nested)


def _refuse_unwritten(session: Session) -> None:
    """Refuse a won block that ended the transaction under the session (a COMMIT or ROLLBACK in
    SQL, a commit() pgonce could not refuse: psycopg's class method, a bound method taken
    before the block) with ORM writes still in the session: they were never sent, and a stored
    response would be replayed for them. pgonce stores nothing then (see ``KeyStore.once``)."""
    changed = sum(1 for instance in session.dirty if session.is_modified(instance))
    unwritten = len(session.new) + changed + len(session.deleted)
    if unwritten:
        raise UsageError(
            f"{_ENDED_IN_BLOCK}, with {unwritten} ORM object(s) of the block not flushed yet: "
            "they were never written, so no response was stored. A commit there committed "
            "the claim with what the block had flushed and enqueued before it, and the key "
            "stays in flight until it expires or is released by hand; a rollback left the key "
            "free"
        )


# The outbox events enqueued through a session while a block of once() is open on it: the
# block's savepoint (its SessionTransaction) -> their ids. Named in the block's error when its
# transaction ended inside it (see _told_events).
_BLOCK_EVENTS = "pgonce_block_events"


def _forget_events(nested: SessionTransaction) -> None:
    blocks = nested.session.info.get(_BLOCK_EVENTS)
    if blocks is not None:
        blocks.pop(nested, None)


def _left(
    error: BaseException, nested: SessionTransaction, driver: Any, stored: bool | None
) -> UsageError | None:
    """Leave the block after ``error`` (see :func:`_leave`); what to raise instead of it (from
    it), or None to raise it as it is.

    When the block's transaction ended inside it, the error names the outbox events that the
    block enqueued: the driver's commit, or a COMMIT in SQL, commits them with the claim before
    pgonce can refuse it, and the relay publishes them. ``stored``: whether the core stored the
    response of a claim so committed (None when it could not tell a commit from a rollback).
    A UsageError of pgonce's is said again with them; another exception (the block's own) gets
    a note."""
    told = _told_events(error, nested, driver, stored)  # before _leave(), which ends the block
    _leave(nested, driver)
    if told is None:
        return None
    if type(error) is UsageError:
        return UsageError(f"{error}; {told}")
    error.add_note(f"pgonce: {told}")
    return None


def _savepoint_gone(cause: BaseException | None) -> bool:
    """Whether ``cause`` is PostgreSQL's answer for a savepoint that no longer exists (ended in
    SQL, behind SQLAlchemy's back), as the driver raised it or as SQLAlchemy wrapped it."""
    return isinstance(cause, sqlalchemy.exc.DBAPIError | psycopg.Error) and isinstance(
        getattr(cause, "orig", cause), psycopg.errors.InvalidSavepointSpecification
    )


def _told_events(
    error: BaseException, nested: SessionTransaction, driver: Any, stored: bool | None
) -> str | None:
    """What became of the outbox events of a block whose transaction ended inside it (see
    :func:`_left`), or None."""
    blocks = nested.session.info.get(_BLOCK_EVENTS)
    ids = blocks.get(nested) if blocks else None
    cause = error.__cause__
    ended = driver.pgconn.transaction_status == _IDLE or _savepoint_gone(cause)
    if not ids or not ended:
        return None
    named = ", ".join(map(str, ids))
    if stored:
        return (
            f"the outbox events {named} enqueued in the block committed with the claim (the "
            "relay publishes them)"
        )
    if stored is False and cause is None:  # the core found the claim rolled back
        return f"the outbox events {named} enqueued in the block were rolled back with it"
    return (
        f"if a commit ended the block's transaction, those of the outbox events {named} "
        "enqueued in the block before it committed with the claim (the relay publishes them); "
        "the others were rolled back, or can only be"
    )


def _open_block(session: Session, driver: Any) -> tuple[SessionTransaction, _Refusals]:
    """What once() and async_once() check before the block, then its savepoint (see
    :func:`_savepoint`): a connection in autocommit (whose SAVEPOINT would fail untyped) and a
    transaction that has failed (whose SAVEPOINT would fail in SQLAlchemy's words) are refused
    as the core store refuses them."""
    require_transaction(driver)
    if driver.pgconn.transaction_status == _INERROR:
        raise UsageError(_FAILED_TRANSACTION)
    _refuse_autocommit(session)
    nested, held = _savepoint(session, driver)
    session.info.setdefault(_BLOCK_EVENTS, {})[nested] = []
    return nested, held


def _savepoint(session: Session, driver: Any) -> tuple[SessionTransaction, _Refusals]:
    """The block's savepoint, begun in the session: its earlier writes flushed, and its SAVEPOINT
    sent now, before pgonce's (SQLAlchemy sends it at the nested transaction's first use, which
    inside the block would put it after pgonce's savepoint, and pgonce's rollback would end it).
    The ``commit()`` of the session, of its connection and of the psycopg connection under them
    (``driver``) are refused until the block's end."""
    with _translated_own("beginning once()'s savepoint"):
        nested = session.begin_nested()
        try:
            connection = session.connection()
        except BaseException:
            _leave(nested, driver)
            raise
    return nested, _Refusals((session, connection, driver), _BLOCK_OWNED)


def _refuse_block_commit() -> None:
    raise BlockCommitRefused()


_UNSET = object()


class _Refusals:
    """Methods of some objects (``commit``, ``rollback``) refused on the instances while the
    transaction they would end is owned elsewhere, and the end of that refusal.

    The one way the block, the batch and the request install theirs: the transaction still ends
    through its ``Transaction`` or ``SessionTransaction`` (the ``session.begin()`` block, the
    block's own savepoint, the batch's ``begin()``, the middleware's COMMIT), never through the
    refused methods. :meth:`release` puts back what was there before, a refusal too (a batch's,
    an outer block's), so that nested owners end in any order of their exits.
    """

    __slots__ = ("_saved",)

    def __init__(
        self, targets: tuple[object, ...], refusals: Mapping[str, Callable[[], None]]
    ) -> None:
        saved = []
        for target in targets:
            own = vars(target)
            for name, refusal in refusals.items():
                saved.append((own, name, own.get(name, _UNSET)))
                own[name] = refusal
        self._saved = saved

    def release(self) -> None:
        for own, name, previous in reversed(self._saved):
            if previous is _UNSET:
                own.pop(name, None)
            else:
                own[name] = previous


_BLOCK_OWNED: Mapping[str, Callable[[], None]] = {"commit": _refuse_block_commit}


def _finish(session: Session, nested: SessionTransaction, won: bool, driver: Any) -> bool:
    """The block's end before its claim completes: a nested transaction the block began and left
    open is refused (pgonce's savepoint, which it is inside, would end it behind SQLAlchemy's
    back, and SQLAlchemy's own end of it then fails the session's transaction), and a won
    block's writes are flushed into its savepoint.

    True, with nothing flushed, when the block ended the transaction under the session (a
    ROLLBACK or COMMIT in SQL, a rollback() of the psycopg connection): a flush would open a new
    one, without the claim. pgonce's exit then settles the claim and raises (see
    ``KeyStore.once``)."""
    if driver.pgconn.transaction_status == _IDLE:
        return True
    current = session.get_nested_transaction()
    if current is not nested and current is not None and _inside(current, nested):
        while current is not None and current is not nested:
            current.rollback()  # its SAVEPOINT still exists: SQLAlchemy's ROLLBACK TO works
            current = session.get_nested_transaction()
        raise UsageError(
            "a session.begin_nested() begun inside once()'s block (or async_once()'s) was still "
            "open at the block's end: end it inside the block (commit() or rollback() it, or "
            "use it as a context manager: with session.begin_nested(): ...). Nothing of the "
            "block was stored and the key is free"
        )
    if won:
        with _translated_writes("flushing once()'s block"):
            session.flush()
            _refuse_writes_elsewhere(session, driver)
    return False


def _refuse_writes_elsewhere(session: Session, driver: Any) -> None:
    """Refuse a block whose session wrote on a connection other than the claim's (``driver``):
    an engine per mapper or table (``binds=``), a ``get_bind()`` that routes, a
    ``session.connection(bind_arguments=...)``. Those writes are in another transaction, which
    the session's commit ends apart from the claim's: a failure between the two commits stores
    the response without them (or them without the claim), and the retry replays it."""
    if _wrote_elsewhere(session, driver):
        raise UsageError(
            "the session of once()'s block (or async_once()'s) wrote on a connection other "
            "than the claim's (an engine per mapper or table with binds=, or a get_bind() "
            "that routes writes elsewhere): those writes would commit in another "
            "transaction, apart from the claim and its stored response. Give the session one "
            "engine for everything the block writes (bind= and binds= on the same engine). "
            "Nothing of the block was stored and the key is free"
        )


def _refuse_handler_writes_elsewhere(session: Session, driver: Any) -> None:
    """Refuse a handler whose session wrote on a connection other than the batch's (``driver``):
    its ``commit()`` would commit those writes on their own, whether or not the batch then
    marks the event done, and a redelivery would run the handler again."""
    if _wrote_elsewhere(session, driver):
        raise UsageError(
            "the inbox handler's session wrote on a connection other than the batch's (its "
            "session_factory has an engine per mapper or table, binds=, or a get_bind() that "
            "routes writes elsewhere): those writes would commit on their own, apart from the "
            "event being marked done. Make the sessions with no engine of their own for what "
            "the handler writes (the session is given the batch's connection as bind=)"
        )


def _wrote_elsewhere(session: Session, driver: Any) -> bool:
    """Whether ``session``'s transaction has written on a connection other than ``driver``.

    Reads there (a replica through ``binds=``) are no writes: only a connection whose
    transaction PostgreSQL has given a transaction id counts. A session on one connection, the
    usual case, sends nothing here.
    """
    # SessionTransaction._connections: what the session's transaction joined, each connection
    # under its own key and its engine's (SQLAlchemy has no public view of it).
    joined = getattr(session.get_transaction(), "_connections", None) or {}
    others = {
        entry[0] for entry in joined.values() if entry[0].connection.driver_connection is not driver
    }
    return any(other.exec_driver_sql(_WROTE).scalar() for other in others)


# Whether the connection's transaction has written (PostgreSQL assigns a transaction id then).
_WROTE = "SELECT txid_current_if_assigned() IS NOT NULL"


# The session's transaction (or _EVERY_TRANSACTION) in which a connection in autocommit is
# refused (see _refuse_autocommit).
_NO_AUTOCOMMIT = "pgonce_no_autocommit"
_EVERY_TRANSACTION = object()


def _refuse_autocommit(session: Session, every: bool = False) -> None:
    """Refuse a connection in autocommit in ``session``'s transaction (in each of its
    transactions with ``every``), one already joined and any it joins later: an engine created
    with ``isolation_level="AUTOCOMMIT"`` (in ``binds=``, or chosen by a ``get_bind()``) commits
    each statement at once, apart from the claim, the outbox events or the inbox event that the
    session's writes go with, and PostgreSQL gives such a connection no transaction that
    :func:`_wrote_elsewhere` could find. The refusal comes before a write reaches it: SQLAlchemy
    joins the connection when the flush first needs it. A read there is refused too: whether a
    statement writes (text(), a function, an executed update()) cannot be told before it runs,
    and there it would commit at once (the how-to says to read a replica on an engine without
    AUTOCOMMIT, or through a session of its own)."""
    transaction = session.get_transaction()
    for entry in getattr(transaction, "_connections", {}).values():
        _refuse_in_autocommit(entry[0])
    session.info[_NO_AUTOCOMMIT] = _EVERY_TRANSACTION if every else transaction
    if not event.contains(session, "after_begin", _joined_in_autocommit):
        event.listen(session, "after_begin", _joined_in_autocommit)


def _joined_in_autocommit(
    session: Session, transaction: SessionTransaction, connection: Connection
) -> None:
    watched = session.info.get(_NO_AUTOCOMMIT)
    if watched is _EVERY_TRANSACTION or (
        watched is not None and watched is session.get_transaction()
    ):
        _refuse_in_autocommit(connection)


def _refuse_in_autocommit(connection: Connection) -> None:
    if getattr(connection.connection.driver_connection, "autocommit", False):
        raise UsageError(
            "a connection of the session's transaction is in autocommit (an engine created "
            'with isolation_level="AUTOCOMMIT", given in binds= or chosen by get_bind()): its '
            "writes would commit at once, apart from pgonce's claim, outbox events or inbox "
            "event, and a read there is refused too (whether a statement writes cannot be told "
            'before it runs). Create that engine without isolation_level="AUTOCOMMIT" (and the '
            "session's writes on one engine with pgonce's), or read it through a session of its "
            "own, apart from this one"
        )


def _inside(current: SessionTransaction, nested: SessionTransaction) -> bool:
    parent = current.parent
    while parent is not None and parent is not nested:
        parent = parent.parent
    return parent is nested


def _leave(nested: SessionTransaction, driver: Any) -> None:
    """Roll back the block's savepoint after a failure; the failure is what the caller sees.

    Deactivated by a failed flush (SQLAlchemy has rolled it back), the rollback sends nothing and
    expunges the block's objects; ended by the caller (or with a savepoint around it), nothing
    of the block's is left to undo.

    When the block ended the transaction under the session behind SQLAlchemy's back (the
    connection ``driver`` is idle, the savepoint still active), no savepoint is left to roll back
    to: SQLAlchemy's ROLLBACK TO would fail, in a new transaction psycopg opens for it. The
    session's connection is invalidated instead (the pool replaces it), and the session's
    transaction rolled back, with no SQL sent.

    A connection lost meanwhile has no savepoint left to roll back either: SQLAlchemy's error
    for it is dropped, and the failure the caller sees (DatabaseUnavailable) stays.
    """
    try:
        _leave_savepoint(nested, driver)
    except sqlalchemy.exc.DBAPIError as error:
        if not _lost(error):
            raise


def _leave_savepoint(nested: SessionTransaction, driver: Any) -> None:
    if driver.pgconn.transaction_status == _IDLE:
        session = nested.session
        if nested.is_active:
            session.connection().invalidate()
        session.rollback()
        return
    if _open_in(nested):
        nested.rollback()


# What a block that ended the session's transaction, and whose claim pgonce had nothing to
# settle for (a replay), is told.
_ENDED_IN_BLOCK = (
    "the transaction that once() joined (or async_once()) ended inside its block (a ROLLBACK or "
    "COMMIT in SQL, or a rollback() of the psycopg connection under the session): end the "
    "session's transaction after the block. The session's transaction was rolled back"
)


def _close_block(nested: SessionTransaction, driver: Any, ended: bool, undone: bool) -> None:
    """The block's end once pgonce settled its claim: refused when the block ended the
    transaction under the session (``ended``: a claim that did not win, which pgonce had
    nothing to settle for), else the savepoint ended: rolled back when ``undone`` (the claim
    won and nothing was stored, a 5xx that is not: pgonce has undone its part, the session's
    objects go with it), released otherwise.

    A savepoint begun before the block and ended inside it (with the block's inside it) is
    refused as the core store refuses it."""
    if ended:
        _leave(nested, driver)
        raise UsageError(_ENDED_IN_BLOCK)
    what = "ending once()'s savepoint"
    if not _open_in(nested):  # a session.begin_nested() of the caller's ended it
        raise UsageError(f"{what} failed: {_OUTER_ENDED}")
    try:
        with _translated_own(what):
            if undone:
                nested.rollback()
            else:
                nested.commit()
    except UsageError as error:
        if not _savepoint_gone(error.__cause__):
            raise
        # Released in SQL, behind SQLAlchemy's back: PostgreSQL has failed the transaction,
        # and SQLAlchemy's rollback (its close too) would fail on the savepoints it still sees.
        # Nothing of the transaction can commit any more: its connections are invalidated (the
        # pool replaces them) and the session's transaction rolled back, with no SQL sent.
        for entry in {entry[0] for entry in getattr(nested, "_connections", {}).values()}:
            entry.invalidate()
        nested.session.rollback()
        raise UsageError(f"{error}. The session's transaction was rolled back") from error.__cause__


def _open_in(nested: SessionTransaction) -> bool:
    """Whether ``nested`` is still one of its session's open transactions."""
    current = nested.session.get_nested_transaction()
    while current is not None and current is not nested:
        current = current.parent
    return current is not None


# What the core store says when a savepoint begun before its block ended inside it.
_OUTER_ENDED = (
    "a savepoint opened before pgonce's was released or rolled back inside pgonce's block, and "
    "pgonce's savepoint ended with it (the claim and the block's writes too); end inner "
    "savepoints first"
)


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
    keys = _checked_store(store, AsyncKeyStore)
    if isinstance(session, async_scoped_session):
        session = session()
    conn = await async_driver_connection(session)
    operation = keys.once(conn, scope, key, fingerprint, wait=wait, now=now)
    nested, held = await session.run_sync(_open_block, conn)
    try:
        try:
            op = await operation.__aenter__()
        except BaseException:
            await greenlet_spawn(_leave, nested, conn)
            raise
        try:
            yield op
            ended = await session.run_sync(_finish, nested, op.won, conn)
            if ended and op.won:
                _refuse_unwritten(session.sync_session)
        except BaseException as error:
            if nested.is_active:  # see once()
                await operation.__aexit__(type(error), error, error.__traceback__)
            if (told := await greenlet_spawn(_left, error, nested, conn, None)) is None:
                raise
            raise told from error
        try:
            await operation.__aexit__(None, None, None)
        except BaseException as error:
            stored = op.stored if ended else None
            if (told := await greenlet_spawn(_left, error, nested, conn, stored)) is None:
                raise
            raise told from error
        await greenlet_spawn(_close_block, nested, conn, ended, op.won and not op.stored)
    finally:
        held.release()
        _forget_events(nested)


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
    """Write an outbox event in the session's transaction; its id (see ``store.outbox.enqueue``).

    The session's commit then refuses (:class:`~pgonce.errors.UsageError`, nothing committed)
    when the session wrote on another connection than the event's (``binds=`` per mapper): the
    event would commit apart from the writes it tells of.
    """
    if isinstance(session, scoped_session):
        session = session()
    conn = driver_connection(session)
    row = event_row(aggregatetype, aggregateid, type, payload, headers, now)
    try:
        written = enqueue_row(conn, row, schema=schema)
    except DatabaseUnavailable:
        if conn.closed:  # lost: SQLAlchemy, which has not seen it, would fail the session's end
            session.connection().invalidate()
        raise
    _watch_outbox(session, conn, written)
    return written


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
    if isinstance(session, async_scoped_session):
        session = session()
    conn = await async_driver_connection(session)
    row = event_row(aggregatetype, aggregateid, type, payload, headers, now)
    try:
        written = await async_enqueue_row(conn, row, schema=schema)
    except DatabaseUnavailable:
        if conn.closed:  # see enqueue()
            await (await session.connection()).invalidate()
        raise
    _watch_outbox(session.sync_session, conn, written)
    return written


# The session's transaction that holds outbox events, and the psycopg connection they are on.
_OUTBOX = "pgonce_outbox"
# The session's listener of its connections' commits (one per session, see _watch_connections).
_OUTBOX_COMMITS = "pgonce_outbox_commits"


def _watch_outbox(session: Session, driver: Any, written: int) -> None:
    """Note the event ``written`` in each block of once() open on ``session`` (see
    :func:`_told_events`), and have ``session``'s commit check that its writes are on
    ``driver``, the connection of the outbox events just enqueued (see :func:`_check_outbox`),
    and so the commit of each connection of its transaction, however it is reached (see
    :func:`_watch_connections`).

    An endpoint's session (idempotent_session(), Flask's session()) is left alone: it is bound
    to the request's connection, and its commit is refused anyway.
    """
    if blocks := session.info.get(_BLOCK_EVENTS):
        for ids in blocks.values():
            ids.append(written)
    if type(session) is _RequestSession:
        return
    _refuse_autocommit(session)
    transaction = session.get_transaction()
    session.info[_OUTBOX] = (transaction, driver)
    if not event.contains(session, "before_commit", _check_outbox):
        event.listen(session, "before_commit", _check_outbox)
    _watch_connections(session, transaction)


def _watch_connections(session: Session, transaction: SessionTransaction | None) -> None:
    """Check each commit of a connection of ``session``'s transaction while it holds outbox
    events, those it joins later too: the session's commit checks before it flushes (see
    :func:`_check_outbox`), and a commit of one of its connections (``session.connection()
    .commit()``, the commit of a ``session.begin()`` block left with a savepoint open, which
    SQLAlchemy begins while the savepoint is still the session's transaction) would otherwise
    commit that connection's transaction apart from the others'."""
    check = session.info.get(_OUTBOX_COMMITS)
    if check is None:

        def check(connection: Connection) -> None:
            _check_outbox_commit(session)

        session.info[_OUTBOX_COMMITS] = check

        def joined(_: Session, __: SessionTransaction, connection: Connection) -> None:
            if session.info.get(_OUTBOX) is not None and not event.contains(
                connection, "commit", check
            ):
                event.listen(connection, "commit", check)

        event.listen(session, "after_begin", joined)
    for entry in getattr(transaction, "_connections", {}).values():
        if not event.contains(entry[0], "commit", check):
            event.listen(entry[0], "commit", check)


def _check_outbox(session: Session) -> None:
    """Refuse the commit of a transaction with outbox events whose session wrote on another
    connection too: the session commits each connection's transaction apart, and the events
    would commit without the writes they tell of (or these without them)."""
    watched = session.info.get(_OUTBOX)
    if watched is None or session.in_nested_transaction():  # a savepoint's release
        return
    transaction, driver = watched
    if transaction is not session.get_transaction():  # an earlier transaction's
        del session.info[_OUTBOX]
        return
    session.flush()  # what the commit would flush next
    if _wrote_elsewhere(session, driver):
        raise UsageError(_OUTBOX_ELSEWHERE)
    del session.info[_OUTBOX]


def _check_outbox_commit(session: Session) -> None:
    """Before a connection of ``session``'s transaction with outbox events commits: refuse it
    when another connection of that transaction, not committed yet, has written (the outbox
    events' own, or another engine's), and roll back every connection of the transaction
    first, so that nothing of it commits whatever is called next."""
    watched = session.info.get(_OUTBOX)
    if watched is None:
        return
    transaction, driver = watched
    if transaction is not session.get_transaction():  # an earlier transaction's
        return
    joined = getattr(transaction, "_connections", None) or {}
    active = {entry[0] for entry in joined.values() if entry[1].is_active}
    others = [c for c in active if c.connection.driver_connection is not driver]
    if not any(other.exec_driver_sql(_WROTE).scalar() for other in others):
        return
    for entry in joined.values():
        # The transactions the session began (not one it joined in a savepoint, whose owner
        # ends it), through SQLAlchemy's DBAPI connection: the async dialect's waits in
        # SQLAlchemy's greenlet.
        if entry[1].is_active and isinstance(entry[1], RootTransaction):
            entry[0].connection.dbapi_connection.rollback()
    raise UsageError(_OUTBOX_ELSEWHERE)


_OUTBOX_ELSEWHERE = (
    "the session enqueued outbox events and wrote on another connection too (an engine "
    "per mapper or table with binds=, or a get_bind() that routes writes elsewhere): "
    "the events would commit apart from the writes they tell of. Give the session one "
    "engine for everything it writes with the events. Nothing was committed"
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
    _refuse_scoped(session_factory, async_scoped_session, "async_sessionmaker", "inbox_handler")
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
                owned = _batch_owned(bound.sync_connection, conn)
                session = session_factory(bind=bound, join_transaction_mode="create_savepoint")
                _refuse_autocommit(session.sync_session, every=True)
                try:
                    async with session:
                        try:
                            returned = handler(event, session)
                            if not inspect.isawaitable(returned):
                                # Its writes roll back below; the worker records the failure.
                                raise UsageError(
                                    "inbox_handler() runs its handler in the async inbox "
                                    "worker, and it must be an async def: this one returned "
                                    f"{type_name(returned)}, not an awaitable (a plain def "
                                    "handler runs with process_batch(), on a sync engine)"
                                )
                            await returned
                            # A write PostgreSQL refuses here (a lock timeout, a deadlock) is
                            # the handler's failure, as when the handler flushes it itself.
                            with _translated_writes("flushing the inbox handler's writes"):
                                await session.flush()
                            with _translated("ending the inbox handler's savepoint"):
                                await session.run_sync(_refuse_handler_writes_elsewhere, conn)
                                await session.commit()  # releases the handler's savepoint
                        except BaseException:
                            await session.rollback()
                            raise
                finally:
                    owned.release()
        finally:
            _borrowed.reset(token)

    return run


def _refuse_scoped(factory: object, scoped: type, maker: str, call: str) -> None:
    """Refuse a scoped session registry as ``session_factory``: it hands each event the same
    session (per thread or task), which refuses the second event's ``bind=``, and every event
    after the first would fail, then be dead-lettered."""
    if isinstance(factory, scoped):
        raise UsageError(
            f"{call}() makes a new session for each event, bound to the event's transaction, and "
            f"a {scoped.__name__} hands out the same one each time: pass its {maker} as "
            f"session_factory (the {scoped.__name__}'s .session_factory), not the "
            f"{scoped.__name__}"
        )


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
    if engine.dialect.is_async:
        raise UsageError(
            "process_batch() takes an engine of create_engine('postgresql+psycopg://...'), and "
            "this one is on postgresql+psycopg_async://: its handlers run in the async inbox "
            "worker, through inbox_handler()"
        )
    _refuse_scoped(session_factory, scoped_session, "sessionmaker", "process_batch")
    store = InboxStore(schema=schema)
    try:
        connected = engine.connect()
    except (sqlalchemy.exc.DBAPIError, sqlalchemy.exc.TimeoutError) as error:
        raise DatabaseUnavailable(f"connecting through the engine failed: {error}") from error
    # The handlers' writes commit at the batch's end: a COMMIT that PostgreSQL refuses (a
    # serialization failure) is raised as SQLAlchemy raises it, the batch rolled back.
    with _translated_writes("an inbox batch"), connected as bound, bound.begin():
        conn = bound.connection.driver_connection
        if not isinstance(conn, psycopg.Connection):  # a custom creator's
            raise NotPsycopgSession(_dialect_name(engine.dialect))
        owned = _batch_owned(bound, conn)

        @contextmanager
        def savepoint() -> Iterator[Session]:
            # The event's savepoint (sent now: a watermark's move happens inside it), around the
            # session's own: a handler's session.commit() releases the session's, so only this
            # one still undoes the handler's writes when it then raises.
            with (
                bound.begin_nested(),
                session_factory(bind=bound, join_transaction_mode="create_savepoint") as session,
            ):
                try:
                    _refuse_autocommit(session, every=True)
                    yield session
                    session.flush()
                    _refuse_handler_writes_elsewhere(session, conn)
                    session.commit()  # releases the savepoint
                    # A write that breaks a deferred constraint would fail the batch's COMMIT,
                    # every event of it, batch after batch: checked now, it fails this event's
                    # savepoint only. Both statements in one round trip (no parameters: the
                    # simple query protocol carries them); every deferrable constraint is then
                    # deferred again for the next handler, as Django's check_constraints() does.
                    # A violation is the handler's write's own error, as psycopg raises it.
                    conn.execute(_CHECK_DEFERRED)
                except BaseException:
                    session.rollback()
                    raise

        try:
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
        finally:
            owned.release()


_CHECK_DEFERRED = b"SET CONSTRAINTS ALL IMMEDIATE; SET CONSTRAINTS ALL DEFERRED"


def _batch_owned(bound: Connection | None, driver: object) -> _Refusals:
    """Refuse a handler's ``commit()`` and ``rollback()`` of ``bound`` (its session's
    ``connection()``) and of the psycopg connection under it (``driver``): the commit would
    commit the events claimed after the handler's as done before their handlers ran, the
    rollback the events before. The batch itself ends through its ``Transaction`` (or the
    worker's own commit), after the release, not through these."""
    assert bound is not None
    return _Refusals((bound, driver), _BATCH_OWNED)


def _refuse_batch_commit() -> None:
    raise TransactionEndRefused("commit")


def _refuse_batch_rollback() -> None:
    raise TransactionEndRefused("rollback")


_BATCH_OWNED: Mapping[str, Callable[[], None]] = {
    "commit": _refuse_batch_commit,
    "rollback": _refuse_batch_rollback,
}


# -- the HTTP path ----------------------------------------------------------------------------

# The SQLAlchemy connection under each psycopg connection that EngineConnections handed out,
# while it is out. A plain dict: EngineConnections.connection() removes its entry when the
# connection goes back, and a WeakKeyDictionary makes a weak reference at every lookup.
_checked_out: dict[psycopg.AsyncConnection[Any], SAAsyncConnection] = {}


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
            sync, conn, owned = await greenlet_spawn(_open, self.engine.sync_engine)
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
            owned.release()
            await bound.close()


def _open(engine: Engine) -> tuple[Connection, Any, _Refusals]:
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
    return connection, driver, _request_owned(connection)


def _request_owned(connection: Connection) -> _Refusals:
    """Refuse the endpoint's ``commit()`` and ``rollback()`` of ``connection`` (its session's
    ``connection()``): the first would commit the claim before its response is stored, the
    second roll it back, and the request's later writes would commit without it. The session's
    own rollback of a failed flush, and the connection's close, end the transaction through its
    ``Transaction``, not these."""
    return _Refusals((connection,), _REQUEST_OWNED)


def _refuse_request_commit() -> None:
    raise SessionCommitRefused()


def _refuse_request_rollback() -> None:
    raise SessionRollbackRefused()


_REQUEST_OWNED: Mapping[str, Callable[[], None]] = {
    "commit": _refuse_request_commit,
    "rollback": _refuse_request_rollback,
}


def _refuse_commit(session: Session) -> None:
    # SQLAlchemy sends before_commit for a savepoint's release too (begin_nested(), async_once()),
    # which commits nothing.
    if not session.in_nested_transaction():
        raise SessionCommitRefused()


class _RequestSession(Session):
    """The sync side of an endpoint's session: its commit and rollback are refused
    (:func:`idempotent_session`).

    The commit's listener is on the class, once, not on each request's session: registering one
    on an instance costs more than the rest of handing out the session. SQLAlchemy has no event
    before a rollback, hence the method; its own rollback of a failed flush does not call it.
    """

    def rollback(self) -> None:
        raise SessionRollbackRefused()


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
    tx = (_transaction_of or _load_transaction_of())(request)
    conn = tx.connection
    bound = _checked_out.get(conn)
    if bound is None:
        raise UsageError(
            "idempotent_session needs the idempotency middleware on EngineConnections(engine): "
            "this request's connection did not come from a SQLAlchemy engine"
        )
    session = AsyncSession(
        bind=bound, join_transaction_mode="rollback_only", sync_session_class=_RequestSession
    )
    joined = bound.sync_connection
    assert joined is not None
    began = joined.get_transaction()  # the middleware's, which the session joins
    try:
        yield session
    except BaseException:
        # The endpoint raised: whatever response Starlette's exception handlers make of it (an
        # HTTPException's 409), its writes roll back with the claim and nothing is stored.
        tx.fail()
        await session.close()
        raise
    if conn.pgconn.transaction_status == _IDLE and not _sqlalchemy_open(bound):
        # A flush failed and SQLAlchemy rolled the request's transaction back (the claim with
        # it), and the endpoint caught the error and answered (a 409 for a duplicate): that
        # answer goes out, not stored, and the retry runs again. A transaction ended behind
        # SQLAlchemy's back (a COMMIT or ROLLBACK in SQL, the psycopg connection's commit()),
        # which SQLAlchemy still sees open, is the endpoint's mistake: the middleware settles
        # the claim it leaves, as for any endpoint (CapturedResponse.ended_by_endpoint()).
        tx.fail()
    sync = session.sync_session
    if _closes_quietly(sync, joined, began):
        sync.close()  # sends nothing: no hop into SQLAlchemy's greenlet
    else:
        # The last flush and the close in one call in SQLAlchemy's greenlet (each would start
        # one).
        await session.run_sync(_flush_and_close)


# pgonce.http.transaction.transaction_of, imported at the first request (the sync parts of this
# module, used by WSGI apps, need no ASGI library), not by an import statement at every request.
_transaction_of: Callable[[Request], IdempotentTransaction] | None = None


def _load_transaction_of() -> Callable[[Request], IdempotentTransaction]:
    global _transaction_of
    from pgonce.http.transaction import transaction_of

    _transaction_of = transaction_of
    return transaction_of


def _sqlalchemy_open(bound: SAAsyncConnection) -> bool:
    """Whether SQLAlchemy still sees the request's transaction open on ``bound`` (no I/O)."""
    sync = bound.sync_connection
    return sync is not None and sync.in_transaction()


def _closes_quietly(session: Session, joined: Connection, began: Transaction | None) -> bool:
    """Whether ``session``'s last flush would find nothing to write and its close would send
    nothing, so that neither needs SQLAlchemy's greenlet (where a statement would wait for the
    database): no object added, deleted or changed since the endpoint's last flush; no savepoint
    left open (the close rolls it back); the session still in the middleware's transaction
    (``began``, on ``joined``), which its close leaves alone, not in one it began itself after a
    failed flush (its close rolls that back); and no listener of the events that the close fires
    (one might use the database)."""
    if began is None or not began.is_active or joined.get_transaction() is not began:
        return False
    dispatch = session.dispatch
    return not (
        session.new
        or session.deleted
        or session.dirty
        or session.get_nested_transaction() is not None
        or dispatch.after_transaction_end
        or dispatch.persistent_to_detached
        or dispatch.deleted_to_detached
    )


def _flush_and_close(session: Session) -> None:
    try:
        session.flush()  # returns at once when there is nothing to write
    finally:
        session.close()
