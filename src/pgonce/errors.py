"""The one exception tree of pgonce.

Expected outcomes (a claim won, a stored response replayed, a duplicate still in flight) are return
values, never exceptions. Exceptions are for broken contracts and for infrastructure failures::

    PgonceError
    ├── ConfigError                   configuration that cannot work; raised before anything starts
    ├── UsageError                    the caller broke the API's contract
    │   ├── NotInTransaction          a write that must commit with the caller's data got autocommit
    │   └── MissingExtra              a part needs an optional extra that is not installed
    ├── KeyMismatch                   same key, different request: never a silent replay
    ├── KeyInFlight                   an idempotent function's key is held by a running call
    ├── LeaseLost                     a two-phase holder was taken over: its writes are refused
    ├── InvalidIdempotencyKey         400: an HTTP request's Idempotency-Key is missing or malformed
    ├── MissingKeyScope               401: a request with a key names no caller (unauthenticated)
    ├── DatabaseError                 PostgreSQL failed; translated once, at the store boundary
    │   ├── DatabaseUnavailable       cannot connect, or the connection died mid-operation
    │   ├── SchemaNotMigrated         pgonce's tables are missing or older than this code
    │   └── MigrationError            a migration failed to apply
    ├── ServiceFailed                 a part of pgonce serve ended with an error and stopped it
    ├── PublishError                  the outbox relay could not hand events to a broker
    │   └── BrokerUnavailable         the broker cannot be reached: the rows wait, nothing is lost
    ├── WebhookError                  a delivery the inbox refuses; each carries its HTTP status
    │   ├── UnknownSource             404: no source of that name is configured
    │   ├── SignatureInvalid          401: missing, malformed or wrong signature
    │   ├── TimestampOutOfTolerance   401: signed too long ago, or in the future
    │   ├── PayloadTooLarge           413: body over the source's limit
    │   ├── BadPayload                400: not UTF-8, or not the JSON the scheme needs
    │   └── EventConflict             409: same event id, different body (an integrity alert)
    └── InboxHandlerError             an inbox handler's run failed in a way pgonce detected
        ├── HandlerTimeout            the handler outlived its source's handler_timeout
        ├── HandlerSwallowedError     the handler caught a database error; its writes cannot commit
        ├── HandlerCancelled          the handler raised CancelledError; the worker was not stopping
        ├── HandlerEndedTransaction   the handler ran COMMIT or ROLLBACK on the worker's transaction
        └── ForwardFailed             the forward target did not accept the event

The first paragraph of the class docstring, on one line, is the default message; every exception
keeps the psycopg error it translates as ``__cause__``.
"""

from __future__ import annotations


class PgonceError(Exception):
    """pgonce failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or _default_message(type(self)))

    def __reduce__(self) -> tuple[object, ...]:
        # Python's own rebuilds an exception by calling the class with its args (the message),
        # which an __init__ of other arguments refuses (KeyInFlight's, KeyMismatch's): unpickling
        # failed with a TypeError, and one raised in a ProcessPoolExecutor's worker broke the
        # whole pool; copy.copy() failed alike. Rebuilt without __init__: the message, then
        # the attributes (the notes too).
        return (_restored, (type(self), self.args), self.__dict__)


def _restored(kind: type[PgonceError], args: tuple[object, ...]) -> PgonceError:
    """An exception of pgonce rebuilt by pickle or copy: see :meth:`PgonceError.__reduce__`."""
    error = kind.__new__(kind, *args)
    error.args = args
    return error


def _default_message(kind: type[BaseException]) -> str:
    """The first paragraph of the class docstring, on one line and without markup."""
    first = (kind.__doc__ or kind.__name__).strip().split("\n\n")[0]
    return " ".join(first.replace("``", "").split())


class ConfigError(PgonceError):
    """The configuration is invalid."""


class UsageError(PgonceError):
    """pgonce was called in a way its API does not allow."""


class NotInTransaction(UsageError):
    """The connection is in autocommit mode outside a transaction, where this write would commit
    alone: open a transaction first (with conn.transaction(): ...).

    A claim, an inbox mark or an outbox row must commit together with the caller's writes, so
    pgonce refuses to write on its own.
    """


class MissingExtra(UsageError, ImportError):
    """A part of pgonce needs an optional extra that is not installed.

    Also an ``ImportError``, so that code written for optional imports keeps working. The message
    names the command that installs what is missing: ``pip install 'pgonce[server]'``.
    """

    def __init__(self, extra: str, feature: str, module: str) -> None:
        super().__init__(
            f"{feature} needs the Python module {module!r}, which is not installed; "
            f"install it with: pip install 'pgonce[{extra}]'"
        )
        self.extra = extra
        self.feature = feature
        self.module = module


class KeyMismatch(PgonceError):
    """The key was already used for a different request."""

    def __init__(self, scope: str, key: str) -> None:
        # The key is the caller's own; the scope names the caller. Neither reveals another
        # caller's data, so both may appear in the message.
        super().__init__(
            f"key {key!r} in scope {scope!r} was first used with a different request; "
            "a key may be retried only with the identical request"
        )
        self.scope = scope
        self.key = key


class KeyInFlight(PgonceError):
    """Another call with this key is still running; retry after ``retry_after`` seconds.

    What :func:`pgonce.idempotent` raises where the key store returns
    :class:`~pgonce.InFlight`: a decorated function must return its result or raise. Nothing ran
    and nothing was written; a message handler that gets it requeues the message.
    """

    def __init__(self, scope: str, key: str, retry_after: int, reason: str) -> None:
        super().__init__(
            f"key {key!r} in scope {scope!r} is held by a call that has not finished "
            f"({reason}); retry after {retry_after} s"
        )
        self.scope = scope
        self.key = key
        self.retry_after = retry_after
        self.reason = reason


class LeaseLost(PgonceError):
    """The key's lease was taken over by a holder with a larger fencing token; this holder's
    write was refused and nothing of it was committed.

    A two-phase holder that outlived its lease (paused, partitioned, slow) may find that a retry
    or the completer took the key over. Every write it makes after its claim names its token, and
    PostgreSQL refuses the write once the key has a larger one: the new holder's recovery points
    and answer stand. The holder must stop; the client's answer is the new holder's.
    """

    def __init__(self, scope: str, key: str, token: int) -> None:
        super().__init__(
            f"key {key!r} in scope {scope!r} was taken over by a newer holder; the write of "
            f"the holder with fencing token {token} was refused"
        )
        self.scope = scope
        self.key = key
        self.token = token


class InvalidIdempotencyKey(PgonceError):
    """The Idempotency-Key header is missing, repeated, empty, too long or malformed.

    The message is written for the HTTP client and never quotes the header's value.
    """

    status = 400
    title = "Invalid Idempotency-Key"


class MissingKeyScope(PgonceError):
    """This request names no caller, so its Idempotency-Key cannot be claimed: authenticate.

    The key scope returned ``None`` (no credentials), so the adapter passed the request on
    without a claim; an endpoint that then asks for the claim's transaction raises this, and the
    adapter answers 401, never a 500.
    """

    status = 401
    title = "Authentication required"


class DatabaseError(PgonceError):
    """PostgreSQL failed."""


class DatabaseUnavailable(DatabaseError):
    """PostgreSQL cannot be reached, or the connection was lost."""


class SchemaNotMigrated(DatabaseError):
    """pgonce's tables are missing or out of date: run `pgonce migrate`."""


class MigrationError(DatabaseError):
    """A migration failed to apply."""


class ServiceFailed(PgonceError):
    """A part of the service (the sweeper, the relay, a worker, the completer) ended with an
    error, and the service stopped with it rather than answer as ready without that part."""


class PublishError(PgonceError):
    """The outbox relay could not hand events to a broker."""


class BrokerUnavailable(PublishError):
    """The broker cannot be reached; the outbox rows stay pending and are published later."""


class WebhookError(PgonceError):
    """A webhook delivery was refused.

    ``status`` is the HTTP status the inbox answers with; ``title`` is a short, public
    description that never contains a secret or the payload.
    """

    status: int = 400
    title: str = "Bad webhook delivery"


class UnknownSource(WebhookError):
    """No webhook source of that name is configured."""

    status = 404
    title = "Unknown webhook source"


class SignatureInvalid(WebhookError):
    """The signature is missing, malformed or does not match."""

    status = 401
    title = "Invalid webhook signature"


class TimestampOutOfTolerance(WebhookError):
    """The signed timestamp is too old or too far in the future."""

    status = 401
    title = "Webhook timestamp out of tolerance"


class PayloadTooLarge(WebhookError):
    """The body is larger than the source allows."""

    status = 413
    title = "Webhook body too large"


class BadPayload(WebhookError):
    """The body is not what the source requires (UTF-8, JSON)."""

    status = 400
    title = "Malformed webhook body"


class EventConflict(WebhookError):
    """The event id was already received with a different body."""

    status = 409
    title = "Webhook event id reused with a different body"


class InboxHandlerError(PgonceError):
    """An inbox handler's run failed; the event is retried with backoff."""


class HandlerTimeout(InboxHandlerError):
    """The handler did not finish within its source's handler_timeout."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the handler did not finish within {seconds:g} s")
        self.seconds = seconds


class HandlerSwallowedError(InboxHandlerError):
    """The handler returned normally after a database error aborted its writes.

    A handler must let database errors propagate: after one, none of its writes can commit.
    """


class HandlerCancelled(InboxHandlerError):
    """The handler raised ``asyncio.CancelledError`` while its worker was not being stopped (a
    task it awaited was cancelled, or it raised the error itself): a failure of that event, which
    is retried, not a cancellation of the worker."""


class HandlerEndedTransaction(InboxHandlerError):
    """The handler ended the worker's transaction (a COMMIT or ROLLBACK in SQL): the events of
    its batch and their marks no longer commit together.

    A handler writes in the worker's transaction and lets the worker end it. When the handler
    committed, its event is dead-lettered (what it wrote before the COMMIT stays: running it
    again could repeat it) and the batch's events whose handlers had not run are set back to
    pending; when it rolled back, the event is retried like any failure.
    """


class ForwardFailed(InboxHandlerError):
    """The forward target did not accept the event (no answer, or not a 2xx)."""
