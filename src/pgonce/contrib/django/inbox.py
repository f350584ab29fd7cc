"""Inbox handlers that write with the Django ORM, in the transaction that marks their event done.

pgonce's :class:`~pgonce.webhooks.worker.InboxWorker` runs async handlers on an async psycopg
connection of its own; Django's ORM cannot join that transaction (the ORM runs on its own sync
connection). So here the claim runs on Django's connection instead: :func:`process_batch` claims a
batch of a source's pending events inside ``transaction.atomic()`` and runs each handler in a
nested ``atomic()`` (a savepoint), so each handler's ORM writes and its event's "done" commit
together. A handler that raises, or leaves a deferred constraint broken (Django's foreign keys
are deferred until COMMIT; they are checked before the handler's savepoint is released), has its
savepoint rolled back and its failure recorded (retry with backoff, then dead letter: the
source's :class:`~pgonce.core.inbox.RetryPolicy`); the other events of the batch commit.

::

    def on_invoice(event: InboxEvent) -> None:
        Invoice.objects.filter(number=event.payload["number"]).update(paid=True)

    while process_batch("stripe", on_invoice):
        pass

Run it from a management command or a periodic task; several processes may run it at once (rows
are claimed with ``FOR UPDATE SKIP LOCKED``). The batch itself is
:func:`pgonce.webhooks.batch.run_batch`, which the SQLAlchemy adapter shares. Not supported here:
LISTEN wake-ups and handler timeouts (the async worker has them).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db import connections, transaction

from pgonce.contrib.django.conf import store_settings
from pgonce.contrib.django.connection import psycopg_connection, wrapper_of
from pgonce.core.inbox import InboxEvent, OutOfOrderPolicy, RetryPolicy
from pgonce.errors import DatabaseUnavailable, InboxHandlerError, UsageError
from pgonce.store._sync.inbox import InboxStore
from pgonce.webhooks.batch import DEFAULT_LIMIT, check_sync, run_batch

#: A handler for the ORM: it gets the event (``payload`` parsed when the body is JSON); what it
#: returns is ignored.
DjangoHandler = Callable[[InboxEvent], object]


def process_batch(
    source: str,
    handler: DjangoHandler,
    *,
    limit: int = DEFAULT_LIMIT,
    retry: RetryPolicy | None = None,
    out_of_order: OutOfOrderPolicy = "process",
    using: str | None = None,
    now: datetime | None = None,
) -> int:
    """Claim up to ``limit`` pending events of ``source`` and run ``handler`` on each.

    ``out_of_order="drop"``: an event whose ordering key has already seen a newer version is
    recorded as skipped and its handler does not run (the watermark moves in the event's own
    savepoint, so a handler that fails leaves it where it was), as in ``pgonce worker``.

    Returns how many events were claimed (0: nothing was due). ``now`` fixes the clock of the
    claim and of the backoff (tests).
    """
    database, schema = store_settings()
    alias = using or database
    store = InboxStore(schema=schema)

    check_sync(handler)
    wrapper_of(alias)  # an alias of settings.DATABASES, before atomic() looks it up

    def handle(event: InboxEvent, _: Any) -> object:
        try:
            returned: object = handler(event)
        except Exception:
            _check_given_back(alias)
            raise
        if inspect.isawaitable(returned):
            return returned  # refused by run_batch: the event is failed, not marked done
        if connections[alias].get_rollback():
            _check_given_back(alias)
            # Said plainly, rather than as the TransactionManagementError of the next query.
            raise InboxHandlerError(
                "the handler marked its transaction for rollback (transaction.set_rollback): "
                "its writes are undone and the event is retried"
            )
        # Django makes foreign keys DEFERRABLE INITIALLY DEFERRED: a handler's broken reference
        # would surface at the batch's COMMIT and take every event of the batch down with it,
        # batch after batch. Checked here, it fails this handler's savepoint only.
        connections[alias].check_constraints()
        return None

    with transaction.atomic(using=alias):
        try:
            return run_batch(
                psycopg_connection(alias),
                source,
                handle,
                lambda: transaction.atomic(using=alias),
                store=store,
                limit=limit,
                retry=retry,
                out_of_order=out_of_order,
                now=now,
            )
        except DatabaseUnavailable as error:
            if connections[alias].closed_in_transaction:
                # Not the database: a handler's connection.close(), met by the next statement.
                raise _closed(alias) from error
            raise
        except _GivenBack:
            raise _closed(alias) from None


class _GivenBack(BaseException):
    """A handler closed a pooled alias's connection (``OPTIONS["pool"]``), which gave it back to
    the pool, where it was rolled back. A BaseException, so that :func:`run_batch` lets it
    through as it does a cancellation, and writes nothing more on a connection the pool holds."""


def _check_given_back(alias: str) -> None:
    """Raise :class:`_GivenBack` when the handler that just ended closed the connection, and
    Django gave it back to its pool (a closed connection of no pool fails the batch's next
    statement instead)."""
    wrapper = connections[alias]
    if wrapper.closed_in_transaction and wrapper.connection is None:
        raise _GivenBack


def _closed(alias: str) -> UsageError:
    return UsageError(
        f"an inbox handler closed the connection of the batch's transaction "
        f"(connections[{alias!r}].close()), which rolled the whole batch back: no "
        "event of it was marked done or failed, and the next batch claims them "
        "again. Let process_batch() end the transaction"
    )
