"""Outbox events written with the ORM's transaction.

::

    with transaction.atomic():
        payment = Payment.objects.create(amount=1000)
        enqueue("payment", str(payment.pk), "payment.created", {"amount": 1000})

The event row commits exactly when the payment does; the relay (``pgonce relay``) publishes it
afterwards. Inside the Idempotency-Key middleware the view is already inside ``atomic()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pgonce.contrib.django.conf import store_settings
from pgonce.contrib.django.connection import psycopg_connection
from pgonce.core.outbox import event_row
from pgonce.store._sync.outbox import enqueue_row


def enqueue(
    aggregatetype: str,
    aggregateid: str,
    type: str,
    payload: Any,
    *,
    headers: Mapping[str, str] | None = None,
    using: str | None = None,
) -> int:
    """Write an outbox event in the current ``transaction.atomic()`` block; its id.

    ``using`` defaults to ``PGONCE["DATABASE"]``. Outside ``atomic()`` this raises
    :class:`~pgonce.errors.NotInTransaction`: the event would commit apart from the ORM's writes.
    """
    database, schema = store_settings()
    conn = psycopg_connection(using or database)
    row = event_row(aggregatetype, aggregateid, type, payload, headers)
    return enqueue_row(conn, row, schema=schema)
