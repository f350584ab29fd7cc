"""What the async and sync store code share that does no I/O: checks, row conversion, statements."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from psycopg.pq import PipelineStatus, TransactionStatus

from pgonce.config import MIN_CLAIM_WAIT, validate_schema
from pgonce.core.checks import check_bool, check_duration, check_int, check_str
from pgonce.core.outcomes import ClaimRow
from pgonce.errors import ConfigError, NotInTransaction, UsageError
from pgonce.sql import Queries

_MILLISECOND = timedelta(milliseconds=1)
#: lock_timeout is an int of milliseconds on the server.
_MAX_LOCK_TIMEOUT_MS = 2**31 - 1


class _HasTransactionState(Protocol):
    @property
    def autocommit(self) -> bool: ...
    @property
    def info(self) -> Any: ...


def require_transaction(conn: _HasTransactionState) -> None:
    """Refuse an autocommit connection outside a transaction: the write would commit alone."""
    if conn.autocommit and (
        (status := conn.info.transaction_status) == TransactionStatus.IDLE
        or (status == TransactionStatus.ACTIVE and outside_blocks(conn))
    ):
        raise NotInTransaction()


def require_free_transaction(conn: Any, call: str) -> None:
    """:func:`require_transaction` for the key store's calls through psycopg's cursors, which
    also refuses a connection running a statement outside psycopg's pipeline: a COPY block
    (``cur.copy()``), whose lock on the connection the call would wait for, for ever from
    inside the block, and a transaction that has failed (its rollback is the caller's). The
    common case (in a transaction, autocommit off) reads two attributes."""
    pgconn = conn.pgconn
    if (status := pgconn.transaction_status) == _ACTIVE:
        if pgconn.pipeline_status == _PIPELINE_OFF:
            raise UsageError(busy(call))
        if conn.autocommit and outside_blocks(conn):
            raise NotInTransaction()
    elif status == _IDLE and conn.autocommit:
        raise NotInTransaction()
    elif status == _INERROR and pgconn.pipeline_status == _PIPELINE_OFF:
        # A statement before the call raised: PostgreSQL ignores everything until the
        # transaction ends, and the call came back as a DatabaseError in its words.
        raise UsageError(
            f"{call} was given a connection whose transaction has failed (a statement before "
            "it raised): roll it back (conn.rollback(), or leave its conn.transaction() block), "
            "which also frees any key it claimed, and claim again in a new one"
        )


def busy(call: str) -> str:
    """What ``call`` on a connection busy with a statement outside psycopg's pipeline is told."""
    return (
        f"{call} was given a connection that is running a statement: a COPY block (cur.copy()) "
        f"in progress, or another thread's statement; inside a COPY block {call} would wait for "
        "the connection for ever. Call it before or after the COPY block, on a connection of "
        "this thread"
    )


_IDLE = TransactionStatus.IDLE
_ACTIVE = TransactionStatus.ACTIVE
_INERROR = TransactionStatus.INERROR
_PIPELINE_OFF = PipelineStatus.OFF


def outside_blocks(conn: object) -> bool:
    """True when psycopg counts no ``conn.transaction()`` block open on the connection.

    What tells an autocommit connection in psycopg's pipeline from one in a transaction: there
    the status is ACTIVE while results are pending, inside a transaction or not, and the
    statements of an autocommit connection outside ``conn.transaction()`` each commit alone at
    the pipeline's next sync. A BEGIN the caller queued by hand is not counted: such a caller is
    refused, and told to open the transaction with ``conn.transaction()``. psycopg keeps the
    count in ``_num_transactions`` (since 3.0); should it ever be gone, nothing is refused on
    its account.
    """
    return not getattr(conn, "_num_transactions", 1)


def hold(conn: Any, by: int) -> None:
    """Count (``by=1``) or uncount (``by=-1``) a transaction pgonce owns among psycopg's blocks.

    Inside ``once(commit=True)`` and a ``commit=True`` decorated call, the block's own code runs
    in the transaction begin() opened; a ``conn.rollback()`` there ended it, the next statement
    opened another, and commit() then committed that work without the claim: run again at every
    retry. Counted, the transaction is psycopg's own ``conn.transaction()`` block to psycopg,
    which refuses ``conn.commit()`` and ``conn.rollback()`` inside it (ProgrammingError) and
    nests a ``conn.transaction()`` as a savepoint. Two additions of an int per owned block.
    """
    if hasattr(conn, "_num_transactions"):
        conn._num_transactions += by


def claim_row(row: tuple[Any, ...] | None) -> ClaimRow:
    # claim() always returns exactly one row; None would mean the function itself is broken.
    assert row is not None, "claim() returned no row"
    state, fingerprint, claimed_at, completed_at, status, headers, body = row
    if type(state) is not str:
        # psycopg reads text as bytes on a SQL_ASCII connection.
        state = bytes(state).decode("ascii")
    return ClaimRow(state, fingerprint, claimed_at, completed_at, status, headers, body)


def complete_claimed(schema: str) -> bytes:
    """commit()'s completion of a claim of begin(): the completion, narrowed to the row's ctid."""
    return Queries("keys", schema).complete + b" AND ctid = %(row)s::tid"


def check_now(now: object) -> Any:
    """``now`` as given, refused unless it is a timezone-aware datetime.

    Called only where a ``now`` was given (None, the database's clock, is never checked): a str
    or an int failed inside the store, as an AttributeError or as a statement PostgreSQL could
    not match (misread as a schema not migrated), and a naive datetime was read in the server's
    TimeZone, whatever the caller meant.
    """
    if not isinstance(now, datetime):
        raise UsageError(
            f"now must be a datetime, not {type(now).__name__} (or None, for the database's clock)"
        )
    if now.utcoffset() is None:
        raise UsageError(
            "now must be a timezone-aware datetime (datetime.now(UTC)): a naive one would be read "
            "in the server's TimeZone"
        )
    try:
        now.astimezone(UTC)
    except OverflowError:
        # Year 1 at +14:00, year 9999 at -14:00: PostgreSQL stores the instant, and the claim's
        # time read back could not be a datetime; the claim stayed in the transaction, with
        # nothing but an OverflowError to say so.
        raise UsageError(
            f"now must be an instant that datetime can hold in UTC, not {now.isoformat()}"
        ) from None
    return now


def check_writes(writes: object, error: BaseException) -> None:
    """After commit() failed on its ``writes`` with ``error``: a UsageError from it when they are
    not a sequence of ``(query, params)`` pairs (the unpacking's ValueError or TypeError said
    neither which argument nor its shape); nothing when they are, and ``error`` is the write's.
    Called only on that failure, so the shape costs the happy path nothing."""
    if isinstance(writes, str | bytes) or not isinstance(writes, Iterable):
        wrong: object = writes
    else:
        try:
            items = list(writes)
        except Exception:  # an iterator already consumed, or one that failed: as it failed
            return
        wrong = next(
            (w for w in items if not isinstance(w, tuple | list) or len(w) != 2),
            _SHAPED,
        )
        if wrong is _SHAPED:
            return
    if isinstance(wrong, tuple | list):
        given = f"a {type(wrong).__name__} of {len(wrong)}"
    else:
        given = f"a {type(wrong).__name__}"
    found = f"not {given}" if wrong is writes else f"not one holding {given}"
    raise UsageError(
        "commit()'s writes must be a sequence of (query, params) pairs, as for conn.execute() "
        f"(params None for none), [(query, params), ...]: {found}"
    ) from error


_SHAPED = object()


def check_wait(wait: object) -> int:
    """Refuse a claim's wait that is not a timedelta of at least ``MIN_CLAIM_WAIT``; the wait in
    milliseconds (PostgreSQL's ``lock_timeout``)."""
    if check_duration(wait, "a claim's wait") < MIN_CLAIM_WAIT:
        raise UsageError(
            f"a claim's wait must be at least {MIN_CLAIM_WAIT.total_seconds() * 1000:.0f} ms: it "
            "bounds every lock the claim's INSERT waits for, and under load a new key's INSERT "
            "can wait that long for an index page, which a shorter wait would report as in flight"
        )
    assert isinstance(wait, timedelta)
    ms = wait // _MILLISECOND
    if ms > _MAX_LOCK_TIMEOUT_MS:
        # The server would refuse the lock_timeout at every claim, after the check passed here.
        raise UsageError(
            f"a claim's wait must be at most {_MAX_LOCK_TIMEOUT_MS} ms (about 24 days), "
            "PostgreSQL's largest lock_timeout"
        )
    return ms


def check_key_settings(
    *, schema: object, wait: object, retry_after: object, store_server_errors: object
) -> int:
    """The settings every store of keys shares (the key store's and the two-phase store's),
    checked in one place so that both refuse the same values with the same
    :class:`~pgonce.errors.UsageError`; the wait in milliseconds."""
    check_schema(schema)
    check_int(retry_after, "retry_after", low=0)
    check_bool(store_server_errors, "store_server_errors")
    return check_wait(wait)


def check_schema(schema: object) -> str:
    """The schema a store (or a middleware, or the webhook receiver) is built for, refused with a
    :class:`~pgonce.errors.UsageError` unless it is a name pgonce's schema may have (the rule of
    ``pgonce migrate``). Taken as it was, it was found out at the first call: a
    ``SchemaNotMigrated`` telling to run ``pgonce migrate``, which refuses the name."""
    try:
        return validate_schema(check_str(schema, "the schema"))
    except ConfigError as error:
        raise UsageError(str(error)) from None
