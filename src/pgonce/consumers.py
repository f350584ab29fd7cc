"""Idempotent consumers: brokers deliver at least once, the handler's effects happen once.

The other side of the outbox. A consumer receives a message (its id is the outbox id, or any id
the producer guarantees stable across redeliveries) and calls :meth:`IdempotentConsumer.handle`:

1. the key store claims ``(consumer name, message id)`` in a new transaction on the consumer's
   connection;
2. if the claim is won, the handler runs on that connection, so its writes belong to the same
   transaction;
3. the claim is completed and the transaction **commits**, its WAL flushed even where
   ``synchronous_commit`` is off; only then does ``handle`` return.

The caller acknowledges the broker message only after ``handle`` returned :attr:`Outcome.PROCESSED`
or :attr:`Outcome.DUPLICATE`. A crash before the commit leaves neither the effects nor the claim,
and the broker redelivers; a crash after the commit but before the ack makes the broker
redeliver a message whose claim is committed, which is answered :attr:`Outcome.DUPLICATE` without
running the handler. A handler that raises rolls everything back and the exception propagates:
do not acknowledge (let the broker redeliver or dead-letter it). :attr:`Outcome.IN_FLIGHT` means
another consumer is processing the same message right now: do not acknowledge; requeue it for
later. The same message id with a different body raises :class:`~pgonce.errors.KeyMismatch`.
A handler that commits or rolls back the transaction itself (a COMMIT or ROLLBACK in SQL) gets a
:class:`~pgonce.errors.UsageError`, and the claim is settled, never left in flight: after a
COMMIT it is completed just after, so a redelivery is a duplicate; after a ROLLBACK nothing
committed, and a redelivery runs the handler again. The same holds when it raises after that end:
the UsageError says what was committed, and the handler's exception is its ``__cause__``. A
handler that catches the cancellation of ``handle()`` and returns is rolled back as a cancelled
one is (CancelledError, logged once): it was cut at an arbitrary await.

Claims of a consumer are key-store rows with the consumer's name as scope, so the retention
sweeper removes them like any other key; keep them longer than the broker can redeliver.
"""

from __future__ import annotations

import asyncio
import enum
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus

from pgonce.core.checks import describe
from pgonce.core.fingerprint import fingerprint
from pgonce.core.inbox import describe_error
from pgonce.core.outcomes import Response, Won
from pgonce.errors import DatabaseUnavailable, UsageError
from pgonce.store._async.keys import AsyncKeyStore

Handler = Callable[[AsyncConnection[Any]], Awaitable[None]]

log = logging.getLogger("pgonce.consumers")

_IDLE = TransactionStatus.IDLE

#: The caller acknowledges the broker once handle() returned: its COMMIT must be durable then.
#: Where the database or role sets ``synchronous_commit = off``, COMMIT returns before the commit
#: record is written, and a server crash after the ack lost the claim and the handler's writes,
#: a message the broker never delivers again. Stronger settings are kept as they are.
_DURABLE_COMMIT = (
    "SELECT CASE WHEN current_setting('synchronous_commit') = 'off' "
    "THEN set_config('synchronous_commit', 'on', true) END"
)
_NOT_ASYNC = "a consumer's handler is an async def function of the connection"


class Outcome(enum.Enum):
    #: The handler ran and its writes committed with the claim: acknowledge the message.
    PROCESSED = "processed"
    #: The message was processed before: acknowledge it, nothing ran.
    DUPLICATE = "duplicate"
    #: Another consumer holds the claim right now: do not acknowledge; requeue for later.
    IN_FLIGHT = "in_flight"

    @property
    def acknowledge(self) -> bool:
        """Whether the broker message may be acknowledged now."""
        return self is not Outcome.IN_FLIGHT


class IdempotentConsumer:
    """Runs a handler at most once per message id for the consumer ``name`` (the claims' scope).

    Use one name per logical consumer (not per process): all replicas of one consumer share the
    claims, which is what makes a redelivery to another replica a duplicate.
    """

    def __init__(self, name: str, *, key_store: AsyncKeyStore | None = None) -> None:
        if not name:
            raise UsageError("a consumer needs a name: it is the scope of its claims")
        self.name = name
        self.key_store = key_store or AsyncKeyStore()

    async def handle(
        self, conn: AsyncConnection[Any], message_id: str, body: bytes, handler: Handler
    ) -> Outcome:
        """Claim ``message_id``, run ``handler(conn)`` if the claim is won, and commit.

        ``conn`` must be idle (no transaction open): the claim and the handler's writes must be
        committed when this returns, so that acknowledging the message is safe.
        """
        if conn.info.transaction_status != TransactionStatus.IDLE:
            raise UsageError(
                "handle() commits its own transaction; call it on an idle connection, "
                "not inside a transaction"
            )
        if not callable(handler):
            raise UsageError(f"{_NOT_ASYNC}, not {describe(handler)}")
        ran = False
        # The handler's own exception, and whether the connection was idle when it raised (the
        # handler had ended the claim's transaction with a COMMIT or ROLLBACK in SQL).
        failed: Exception | None = None
        idle_at_failure = False
        try:
            async with self.key_store.once(
                conn, self.name, message_id, fingerprint(body), commit=True
            ) as op:
                if op.won:
                    task = asyncio.current_task()
                    cancelling = 0 if task is None else task.cancelling()
                    running = handler(conn)
                    if not inspect.isawaitable(running):
                        raise UsageError(
                            f"{_NOT_ASYNC}: it returned {describe(running)}; it ran, and its "
                            "writes are rolled back with the claim (do not acknowledge)"
                        )
                    try:
                        await running
                    except Exception as error:
                        failed = error
                        idle_at_failure = conn.pgconn.transaction_status == _IDLE
                        raise
                    if task is not None and task.cancelling() > cancelling:
                        raise self._ignored_cancel(message_id)
                    ran = True
                    op.respond(Response())
                    # Sent with the completion and COMMIT, in their round trip (no parameters: the
                    # cached conversion of a queued write).
                    op.execute(_DURABLE_COMMIT, ())
        except Exception as error:
            if error is failed:
                settled = await self._after_failure(conn, op, failed, idle_at_failure)
                if settled is None:
                    raise
                raise settled from failed
            if isinstance(error, UsageError):
                if (
                    ran
                    and conn.pgconn.transaction_status == _IDLE
                    and not conn.closed
                    and isinstance(claim := op.claim, Won)
                ):
                    # The handler ended the claim's transaction itself and ran nothing after:
                    # the key store refused to complete a claim no longer in its transaction.
                    settled = await self._settle(conn, claim)
                    raise settled from settled.__cause__ or error
                raise
            if isinstance(error, DatabaseUnavailable) and conn.closed and not conn.broken:
                # Not an outage to retry: every redelivery would close it again.
                raise UsageError(
                    "the handler closed the connection it was given: its writes and the claim "
                    "rolled back with it (do not acknowledge); a handler leaves the connection "
                    "open and its transaction to handle()"
                ) from error
            raise
        if op.won:
            return Outcome.PROCESSED
        if op.replayed:
            return Outcome.DUPLICATE
        return Outcome.IN_FLIGHT

    def _ignored_cancel(self, message_id: str) -> asyncio.CancelledError:
        """The cancellation of handle() that the handler caught and returned from: whatever it
        was doing was cut at an arbitrary await, so its writes must not commit as a finished
        run; they roll back with the claim, as a cancellation's would."""
        log.warning(
            "the handler of consumer %s caught the cancellation of handle() for message %s and "
            "returned: its writes and the claim are rolled back, as a cancellation's are (do not "
            "acknowledge; a redelivery runs the handler again). A handler lets "
            "asyncio.CancelledError propagate",
            self.name,
            message_id,
        )
        return asyncio.CancelledError()

    async def _after_failure(
        self, conn: AsyncConnection[Any], op: Any, failed: Exception, idle: bool
    ) -> UsageError | None:
        """The error for a handler that raised ``failed``, when it had ended the claim's
        transaction first (a COMMIT or ROLLBACK in SQL); None for a plain failure, which rolled
        back everything and goes on as it was raised.

        A COMMIT committed the claim, in flight, with the writes before it: every redelivery
        would have been answered IN_FLIGHT until the key expired, and the writes could not be
        run again anyway. The claim is completed, so a redelivery is a duplicate. A connection
        idle when the handler raised had its transaction ended; on a connection with autocommit
        off, psycopg opens a new transaction at the next statement, which hides the end: its
        claim is looked for after every failure, one round trip on the failure path only.
        """
        claim = op.claim
        if (
            not isinstance(claim, Won)
            or conn.closed
            or conn.pgconn.transaction_status != _IDLE
            or not (idle or not conn.autocommit)
        ):
            return None
        then = f"and then raised {describe_error(failed)}"
        try:
            async with conn.transaction():
                found = await self.key_store.complete(conn, claim, Response())
        except Exception as error:
            if not idle:
                return None  # nothing says the handler ended anything: its own failure
            return UsageError(
                f"{_ENDED}, {then}; completing the claim it may have committed failed "
                f"({describe_error(error)}), so the key may stay in flight until it expires "
                "(do not acknowledge)"
            )
        if found:
            after = (
                "what it wrote after the COMMIT was committed by autocommit as it ran"
                if conn.autocommit
                else "what it wrote after the COMMIT was rolled back"
            )
            return UsageError(
                f"{_ENDED}, {then}: its COMMIT had committed the claim with the handler's "
                f"writes before it, which are done; {after}. The claim was completed after "
                "it, so a redelivery of the message is answered Outcome.DUPLICATE and does not "
                "run them again"
            )
        if not idle:
            return None
        after = (
            "; what it wrote after the ROLLBACK was committed by autocommit as it ran"
            if conn.autocommit
            else ""
        )
        return UsageError(
            f"{_ENDED}, {then}: the claim was rolled back with the handler's writes before its "
            f"ROLLBACK{after} (do not acknowledge), and a redelivery of the message runs the "
            "handler again"
        )

    async def _settle(self, conn: AsyncConnection[Any], claim: Won) -> UsageError:
        """The error for a handler that committed or rolled back the claim's transaction itself
        (a COMMIT or ROLLBACK in SQL) and ran nothing after, once the claim is settled.

        A COMMIT committed the claim with the handler's writes before it was completed: they are
        done, so the claim is completed now, in a transaction of its own, and a redelivery is a
        duplicate, not a claim in flight until its key expires. A ROLLBACK took the claim with
        the writes: the completion finds nothing, and a redelivery runs the handler again. The
        extra round trip is on this misuse's path only.
        """
        try:
            async with conn.transaction():
                found = await self.key_store.complete(conn, claim, Response())
        except Exception as error:
            failure = UsageError(
                f"{_ENDED}; completing the claim it may have committed failed ({error}), so "
                "the key may stay in flight until it expires (do not acknowledge)"
            )
            failure.__cause__ = error
            return failure
        if found:
            return UsageError(
                f"{_ENDED}: its commit had committed the claim with the handler's writes, so the "
                "claim was completed after it, and a redelivery of the message is answered "
                "Outcome.DUPLICATE"
            )
        return UsageError(
            f"{_ENDED}: the claim was rolled back with the handler's writes, nothing was done, "
            "and a redelivery of the message runs the handler again (do not acknowledge)"
        )


#: What a handler that ended handle()'s transaction itself is told (see IdempotentConsumer._settle).
_ENDED = (
    "the handler committed or rolled back the transaction handle() gave it (a COMMIT or ROLLBACK "
    "in SQL); handle() commits it once the claim is completed: undo a part with a savepoint "
    "(conn.transaction()), or raise to undo it all"
)
