"""One batch of a source's inbox events, in a transaction an ORM opened (sync).

:class:`~pgonce.webhooks.worker.InboxWorker` owns its connection and its transaction, and runs
async handlers. A handler that writes through an ORM has to run on the ORM's connection, inside
the ORM's transaction, or its writes and its event's "done" would commit apart. :func:`run_batch`
is what the ORM adapters (:mod:`pgonce.contrib.django.inbox`, :mod:`pgonce.contrib.sqlalchemy`)
share: on the psycopg connection under the ORM, in the transaction the adapter opened, it claims a
batch of the source's due events (which marks them done, ``FOR UPDATE SKIP LOCKED``), and runs
each one's handler in a savepoint the adapter opens its own way (``atomic()``, a ``Session``'s
SAVEPOINT). A handler that raises has its savepoint rolled back, and then its failure is recorded
(retry after a backoff, dead letter after the policy's last attempt) and logged with what happens
next, as the worker logs it: the first failure of a kind (the source, the exception's type, dead
or not) at once, then at most one a minute for the whole process, however many batches fail that
way (:mod:`pgonce.core.throttle`). The batch's other events commit with the adapter's
transaction.

Every event gets a savepoint, so one failing handler never reruns the others: a batch run here
is a loop of a management command or a periodic task, where a round trip per event is cheap and
a rerun of the other handlers is not. The async worker's LISTEN wake-ups and handler timeouts are
not here: a sync handler cannot be interrupted, and the caller's loop decides when to look again.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, TypeVar

from psycopg import Connection
from psycopg.pq import TransactionStatus

from pgonce.core.inbox import (
    DeadLetter,
    InboxEvent,
    OutOfOrderPolicy,
    RetryPolicy,
    after_failure,
    describe_error,
    needs_watermark,
    parse_json,
)
from pgonce.core.throttle import Throttle
from pgonce.errors import BadPayload, HandlerEndedTransaction, UsageError
from pgonce.store._sync.inbox import InboxStore
from pgonce.webhooks.failures import report_failure

log = logging.getLogger("pgonce.inbox")

_IDLE = TransactionStatus.IDLE
#: A connection's states after an event's savepoint failed to end (its transaction, or the
#: savepoint, ended by the handler).
_GONE = (TransactionStatus.IDLE, TransactionStatus.INERROR)

__all__ = ["DEFAULT_LIMIT", "run_batch"]

#: Events claimed per call: their rows stay locked, and their "done" uncommitted, until the last
#: handler of the batch returned.
DEFAULT_LIMIT = 50

T = TypeVar("T")

_NOT_SYNC = (
    "the handler of a batch runs in the ORM's transaction and must be a plain def: an async def "
    "handler returns a coroutine that nobody awaits (run async handlers with InboxWorker)"
)


def check_sync(handler: object) -> None:
    """:class:`~pgonce.errors.UsageError` for an ``async def`` handler (or an object whose
    ``__call__`` is one), before anything is claimed: a batch's handler runs in the ORM's
    transaction, where its coroutine would never be awaited and its event marked done."""
    if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 (an object whose __call__ is async def)
    ):
        raise UsageError(_NOT_SYNC)


# One throttle for every batch of the process (batches may run in threads side by side): a loop
# of batches that fail alike logs as one worker does.
_throttle = Throttle()


def with_payload(event: InboxEvent) -> InboxEvent:
    """``event`` with ``payload`` parsed when its body is JSON; as it is otherwise."""
    try:
        return replace(event, payload=parse_json(event.body))
    except BadPayload:
        return event


def run_batch(
    conn: Connection[Any],
    source: str,
    handle: Callable[[InboxEvent, T], object],
    savepoint: Callable[[], AbstractContextManager[T]],
    *,
    store: InboxStore,
    limit: int = DEFAULT_LIMIT,
    retry: RetryPolicy | None = None,
    out_of_order: OutOfOrderPolicy = "process",
    now: datetime | None = None,
) -> int:
    """Claim up to ``limit`` due events of ``source`` on ``conn`` and run ``handle`` on each.

    ``conn`` is inside the transaction that will commit the batch (the caller commits it; a
    connection outside a transaction is refused with
    :class:`~pgonce.errors.NotInTransaction`). Each event runs in ``with savepoint() as s:``,
    as ``handle(event, s)``, its ``payload`` parsed when the body is JSON. With
    ``out_of_order="drop"``, an event older than its ordering key's watermark is recorded as
    skipped, its handler not run; the watermark moves inside the event's savepoint, so a handler
    that fails leaves it where it was. Returns how many events were claimed (0: none was due).
    ``now`` fixes the clock of the claim, the watermark and the backoff (tests).
    """
    if out_of_order not in ("process", "drop"):
        raise UsageError(f"out_of_order is 'process' or 'drop', not {out_of_order!r}")
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise UsageError(f"retry must be a RetryPolicy, not {type(retry).__qualname__}")
    check_sync(handle)
    policy = retry or RetryPolicy()
    events = store.claim(conn, source, limit=limit, now=now)
    for number, event in enumerate(events, 1):
        # Set when the handler ended the batch's transaction: the savepoint's end then fails,
        # and its error would hide this one.
        ended_by: HandlerEndedTransaction | None = None
        try:
            with savepoint() as opened:
                if needs_watermark(out_of_order, event) and not store.advance_watermark(
                    conn, event, now=now
                ):
                    store.skip(conn, event)
                    continue
                try:
                    returned = handle(with_payload(event), opened)
                except Exception as raised:
                    if conn.pgconn.transaction_status == _IDLE:
                        ended_by = HandlerEndedTransaction(
                            f"{HandlerEndedTransaction()} (and then raised "
                            f"{describe_error(raised)})"
                        )
                        raise ended_by from raised
                    raise
                if conn.pgconn.transaction_status == _IDLE:
                    ended_by = HandlerEndedTransaction()
                    raise ended_by
                if inspect.isawaitable(returned):
                    # Never awaited, it did nothing: the event must not be marked done.
                    if inspect.iscoroutine(returned):
                        returned.close()  # no "never awaited" warning: this error says it
                    raise UsageError(_NOT_SYNC)
        except Exception as error:
            if ended_by is None and conn.pgconn.transaction_status in _GONE:
                # The savepoint's end failed, so the batch's transaction is gone: the handler
                # ended it or the savepoint (and then ran a statement, which opened another).
                # A closed connection is not this: the caller says what it is.
                ended_by = HandlerEndedTransaction(
                    f"{HandlerEndedTransaction()} (its savepoint could not end: "
                    f"{describe_error(error)})"
                )
            if ended_by is not None:
                # The batch is no longer one transaction: what its end left must be found out.
                ended(conn, store, event, ended_by, events[number:], policy, now)
                return len(events)
            # The savepoint was rolled back: the handler's writes and the watermark's move with
            # it. A cancellation (KeyboardInterrupt, SystemExit) is no Exception: it reaches the
            # caller, whose transaction then rolls the whole batch back.
            clock = now or datetime.now(UTC)
            decision = after_failure(policy, event.attempts, now=clock)
            store.fail(conn, event, decision, describe_error(error), now=now)
            report_failure(_throttle, event, error, decision, clock)
    return len(events)


def ended(
    conn: Connection[Any],
    store: InboxStore,
    event: InboxEvent,
    error: HandlerEndedTransaction,
    unrun: Sequence[InboxEvent],
    policy: RetryPolicy,
    now: datetime | None,
) -> None:
    """``event``'s handler ended the batch's transaction; the batch stops there, and what it left
    is set right in a transaction committed here (the caller's may be marked for rollback).

    Committed: the events before it are done with their handlers' writes; its own is
    dead-lettered (what its handler wrote before the COMMIT stays, and a rerun could repeat it);
    ``unrun``, marked done by the claim without running, are set back to pending. Rolled back:
    the batch is undone, and the event is retried like any failure."""
    clock = now or datetime.now(UTC)
    if conn.pgconn.transaction_status != _IDLE:
        # The savepoint's end ran in a transaction of its own and failed (no savepoint left).
        conn.execute("ROLLBACK")
    # Not in a transaction: the statements below open one, which this function commits.
    committed = store.claim_committed(conn, event)
    if committed:
        store.fail(conn, event, DeadLetter(), describe_error(error), now=now)
        reopened = store.reopen(conn, unrun)
    else:
        decision = after_failure(policy, event.attempts, now=clock)
        store.fail(conn, event, decision, describe_error(error), claimed=False, now=now)
    conn.execute("COMMIT")
    if committed:
        log.error(
            "inbox: the handler of %s event %s ran COMMIT on its batch's transaction: the events "
            "before it are done, it is dead-lettered (what it wrote before the COMMIT stays; "
            "check it, then replay it with `pgonce replay --source %s --event-id %s`), and the "
            "%d after it are pending again; a handler writes in the batch's transaction and "
            "leaves its end to the batch",
            event.source,
            event.id,
            event.source,
            event.id,
            reopened,
        )
    else:
        report_failure(_throttle, event, error, decision, clock)
