"""Idempotent consumers: brokers deliver at least once, the handler's effects happen once.

The other side of the outbox. A consumer receives a message (its id is the outbox id, or any id
the producer guarantees stable across redeliveries) and calls :meth:`IdempotentConsumer.handle`:

1. the key store claims ``(consumer name, message id)`` in a new transaction on the consumer's
   connection;
2. if the claim is won, the handler runs on that connection, so its writes belong to the same
   transaction;
3. the claim is completed and the transaction **commits**; only then does ``handle`` return.

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
committed, and a redelivery runs the handler again.

Claims of a consumer are key-store rows with the consumer's name as scope, so the retention
sweeper removes them like any other key; keep them longer than the broker can redeliver.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus

from pgonce.core.checks import describe
from pgonce.core.fingerprint import fingerprint
from pgonce.core.outcomes import Response, Won
from pgonce.errors import DatabaseUnavailable, UsageError
from pgonce.store._async.keys import AsyncKeyStore

Handler = Callable[[AsyncConnection[Any]], Awaitable[None]]

_IDLE = TransactionStatus.IDLE
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
        try:
            async with self.key_store.once(
                conn, self.name, message_id, fingerprint(body), commit=True
            ) as op:
                if op.won:
                    running = handler(conn)
                    if not inspect.isawaitable(running):
                        raise UsageError(
                            f"{_NOT_ASYNC}: it returned {describe(running)}; it ran, and its "
                            "writes are rolled back with the claim (do not acknowledge)"
                        )
                    await running
                    ran = True
                    op.respond(Response())
        except UsageError as error:
            if (
                ran
                and conn.pgconn.transaction_status == _IDLE
                and not conn.closed
                and isinstance(claim := op.claim, Won)
            ):
                # The handler ended the claim's transaction itself and ran nothing after: the
                # key store refused to complete a claim no longer in its transaction.
                settled = await self._settle(conn, claim)
                raise settled from settled.__cause__ or error
            raise
        except DatabaseUnavailable as error:
            if conn.closed and not conn.broken:
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
