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
are claimed with ``FOR UPDATE SKIP LOCKED``). Not supported here: LISTEN wake-ups and handler
timeouts (the async worker has them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime

from django.conf import settings
from django.db import connections, transaction

from pgonce.config import DEFAULT_SCHEMA
from pgonce.contrib.django.connection import psycopg_connection
from pgonce.core.inbox import (
    InboxEvent,
    OutOfOrderPolicy,
    RetryPolicy,
    after_failure,
    describe_error,
    needs_watermark,
    parse_json,
)
from pgonce.errors import BadPayload
from pgonce.store._sync.inbox import InboxStore

log = logging.getLogger("pgonce.inbox")

#: A handler for the ORM: it gets the event (``payload`` parsed when the body is JSON).
DjangoHandler = Callable[[InboxEvent], None]


def _payload(event: InboxEvent) -> InboxEvent:
    try:
        return replace(event, payload=parse_json(event.body))
    except BadPayload:
        return event


def process_batch(
    source: str,
    handler: DjangoHandler,
    *,
    limit: int = 50,
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
    pgonce = getattr(settings, "PGONCE", None) or {}
    alias = using or pgonce.get("DATABASE", "default")
    store = InboxStore(schema=pgonce.get("SCHEMA", DEFAULT_SCHEMA))
    policy = retry or RetryPolicy()
    with transaction.atomic(using=alias):
        conn = psycopg_connection(alias)
        events = store.claim(conn, source, limit=limit, now=now)
        for event in events:
            try:
                with transaction.atomic(using=alias):
                    if needs_watermark(out_of_order, event) and not store.advance_watermark(
                        conn, event, now=now
                    ):
                        store.skip(conn, event)
                        continue
                    handler(_payload(event))
                    # Django makes foreign keys DEFERRABLE INITIALLY DEFERRED: a handler's
                    # broken reference would surface at the batch's COMMIT and take every
                    # event of the batch down with it, batch after batch. Checked here, it
                    # fails this handler's savepoint only.
                    connections[alias].check_constraints()
            except Exception as error:
                decision = after_failure(policy, event.attempts, now=now or datetime.now(UTC))
                log.info(
                    "inbox event %s/%s failed (%s): %s",
                    event.source,
                    event.id,
                    type(error).__qualname__,
                    decision.status,
                )
                store.fail(conn, event, decision, describe_error(error), now=now)
    return len(events)
