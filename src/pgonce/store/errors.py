"""Translation of psycopg errors into pgonce's exception tree, once, at the store boundary.

The psycopg error stays attached as ``__cause__``; messages name the host and the cause, never the
password of a connection string.
"""

from __future__ import annotations

from types import TracebackType

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict

from pgonce.core.durability import READ_ONLY_DETAIL
from pgonce.errors import (
    ConfigError,
    DatabaseError,
    DatabaseUnavailable,
    PgonceError,
    SchemaNotMigrated,
    UsageError,
)

# SQLSTATEs that mean "pgonce's objects are not there": the schema was never migrated.
_MISSING_OBJECT = (
    pg_errors.UndefinedTable,
    pg_errors.UndefinedFunction,
    pg_errors.InvalidSchemaName,
)


# What PgBouncer answers BEGIN with in pool_mode = statement.
_STATEMENT_POOLING = "transaction blocks not allowed in statement pooling mode"


# What a standby answers a read of an unlogged table with.
_IN_RECOVERY = "unlogged relations during recovery"


def describe_dsn(dsn: str) -> str:
    """``host:port/dbname`` of a connection string, without user or password.

    In a URI everything before the last ``@`` (ahead of the query) is taken for the login, so that
    a password with an unescaped ``@`` or ``/`` (which libpq reads as part of the host or the
    database name) is never shown.
    """
    scheme, sep, rest = dsn.partition("://")
    if sep:
        head, question, query = rest.partition("?")
        dsn = f"{scheme}://{head.rpartition('@')[2]}{question}{query}"
    try:
        params = conninfo_to_dict(dsn)
    except (psycopg.ProgrammingError, UnicodeEncodeError):  # the latter: a byte not UTF-8
        return "an unparsable connection string"
    host = str(params.get("host") or params.get("hostaddr") or "localhost")
    port = str(params.get("port") or "5432")
    dbname = str(params.get("dbname") or params.get("user") or "")
    where = f"{host}:{port}" if not host.startswith("/") else f"socket {host}"
    return f"{where}/{dbname}" if dbname else where


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def unencodable(what: str, error: UnicodeEncodeError) -> str:
    """What a caller is told when ``what`` has a character the connection cannot send."""
    bad = str(error.object[error.start : error.end])
    return (
        f"{what} failed: {bad!r} cannot be sent in the connection's encoding "
        f"({error.encoding}): pgonce's text arguments (a scope, a key, an event's aggregate) "
        "must be characters that the connection's client_encoding carries, and no lone surrogates"
    )


def read_only_refusal(error: BaseException) -> bool:
    """Whether ``error`` (pgonce's, from :class:`translate_errors`) says the node takes no writes:
    a standby, or a read-only default. Every later write on that connection fails the same way."""
    cause = error.__cause__
    return isinstance(cause, pg_errors.ReadOnlySqlTransaction) or (
        isinstance(cause, pg_errors.FeatureNotSupported) and _IN_RECOVERY in str(cause)
    )


def translated(error: Exception, what: str) -> Exception:
    """``error`` as :class:`translate_errors` says it (``what`` failed), when it is psycopg's
    loss of the server met outside the store's statements (a loop's BEGIN, a new connection's
    first check): DatabaseUnavailable, or the ConfigError of a pooler in statement mode, which
    refuses every transaction and which no reconnect ends. Any other error is returned as is.
    """
    if not isinstance(error, psycopg.OperationalError):
        return error
    try:
        with translate_errors(what):
            raise error
    except PgonceError as said:
        return said


class translate_errors:  # named like the function it replaced: ``with translate_errors(...)``
    """Run a store operation; re-raise psycopg failures as pgonce errors naming ``what`` failed.

    A class rather than a generator-based context manager: it sits on the key store's hot path,
    twice per transaction, where a generator's setup cost shows.
    """

    __slots__ = ("what",)

    #: Whether the statement runs in the caller's transaction (:class:`translate_caller_errors`).
    caller = False

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if error is None:
            return
        said = self.said(error)
        if said is not None:
            raise said from error

    def said(self, error: BaseException) -> PgonceError | None:
        """``error`` as pgonce says it (``what`` failed), or None for an error that is not the
        database's (it is raised as is). The caller raises it ``from error``."""
        if not isinstance(error, psycopg.Error):
            if isinstance(error, UnicodeEncodeError):
                # psycopg dumping a str parameter (a scope, a key, an aggregate's id) that the
                # connection's client_encoding cannot carry, or a lone surrogate.
                return UsageError(unencodable(self.what, error))
            if isinstance(error, UnicodeDecodeError):
                # psycopg's json loaders read json and jsonb as UTF-8 whatever the connection's
                # client_encoding, in which the server sends them: a stored response's headers
                # with a character beyond ASCII, replayed on a LATIN1 connection.
                return UsageError(
                    f"{self.what} failed: PostgreSQL sent JSON in the connection's "
                    f"client_encoding, which is not UTF-8, and psycopg reads JSON as UTF-8 "
                    f"({error.reason} at byte {error.start}): connect with client_encoding UTF8"
                )
            return None
        what = self.what
        if isinstance(error, _MISSING_OBJECT):
            return SchemaNotMigrated(
                f"{what} failed: {first_line(error)}; run `pgonce migrate` on this database"
            )
        if isinstance(error, pg_errors.UntranslatableCharacter):
            # The server converting what it sends into the connection's client_encoding: a
            # stored response's headers (or an event's) with a character that LATIN1 (or another
            # single-byte encoding) has no byte for, read on such a connection.
            return UsageError(
                f"{what} failed: {first_line(error)}: the stored row holds characters that the "
                "connection's client_encoding cannot carry; connect with client_encoding UTF8"
            )
        if isinstance(error, pg_errors.InvalidSavepointSpecification):
            # Class 3B is an OperationalError to psycopg, but no retry finds the savepoint: a
            # statement outside pgonce ended it (a ROLLBACK TO or RELEASE of a savepoint opened
            # before pgonce's, such as SQLAlchemy's begin_nested() or Django's atomic()).
            return UsageError(
                f"{what} failed: {first_line(error)}: a savepoint opened before pgonce's was "
                "released or rolled back inside pgonce's block, and pgonce's savepoint ended "
                "with it (the claim and the block's writes too); end inner savepoints first"
            )
        if isinstance(error, psycopg.OperationalError) and _STATEMENT_POOLING in str(error):
            # PgBouncer's pool_mode = statement: no retry ever gets a transaction there.
            return ConfigError(
                f"{what} failed: {first_line(error)}: pgonce's claim, the work and the stored "
                "response are one transaction, which a pooler in statement mode does not allow; "
                'use PgBouncer\'s pool_mode = transaction (with pooler = "pgbouncer-transaction") '
                "or session"
            )
        if isinstance(error, psycopg.OperationalError):
            return self.unavailable(error)
        if isinstance(error, pg_errors.FeatureNotSupported) and _IN_RECOVERY in str(error):
            # A standby refuses to read an unlogged table (pgonce's outbox_aggregates) before it
            # refuses a write: the same node that takes no writes, said in other words.
            return DatabaseUnavailable(f"{what} failed: {first_line(error)}: {READ_ONLY_DETAIL}")
        if isinstance(error, pg_errors.ReadOnlySqlTransaction):
            # A node that takes no writes: after a failover the old primary, now a standby, or a
            # DSN that reached a replica. Unavailable (a 503 with Retry-After from the
            # middleware), not a failure of the code: the primary takes the retry.
            # Only a caller's transaction may have been opened read-only by the caller: in one
            # pgonce owns (a relay's claim, a sweep) there is nothing of the caller's to end.
            ending = ", or end the caller's read-only transaction" if self.caller else ""
            return DatabaseUnavailable(
                f"{what} failed: {first_line(error)}: {READ_ONLY_DETAIL}{ending}"
            )
        return DatabaseError(f"{what} failed: {first_line(error)}")

    def unavailable(self, error: BaseException) -> DatabaseUnavailable:
        """What the loss of the server (``error``, psycopg's) while ``what`` ran is said as."""
        return DatabaseUnavailable(f"{self.what} failed: {first_line(error)}")


class translate_caller_errors(translate_errors):
    """:class:`translate_errors` for a statement in the caller's transaction (a claim of a key,
    an enqueue): a read-only refusal also says the caller's own transaction may be the cause."""

    __slots__ = ()

    caller = True
