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
from pgonce.store._sync.outbox import enqueue as enqueue_on


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
    alias = using or database
    return enqueue_on(
        psycopg_connection(alias),
        aggregatetype,
        aggregateid,
        type,
        payload,
        headers=headers,
        schema=schema,
    )
