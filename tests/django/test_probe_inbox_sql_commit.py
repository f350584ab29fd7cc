"""A Django process_batch() handler that runs COMMIT in SQL: the batch stops there, the events
whose handlers had not run are pending again (not done unrun), the committing one is
dead-lettered (not run again), on a real database."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection

from examples.django_payments.payments.models import Payment
from pgonce.contrib.django.inbox import process_batch
from tests.django.test_django import _deliver

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_handlers_sql_commit_loses_no_event_and_repeats_none() -> None:
    source = f"probe-{uuid.uuid4().hex[:8]}"
    _deliver(*({"n": n} for n in range(3)), source=source)

    def handler(event: Any) -> None:
        Payment.objects.create(principal=event.id, amount=1, currency="EUR")
        if event.id == "evt-1":
            with connection.cursor() as cur:
                cur.execute("COMMIT")

    process_batch(source, handler, now=datetime.now(UTC))
    with connection.cursor() as cur:
        cur.execute(
            "SELECT event_id, status, attempts FROM pgonce.inbox WHERE source = %s",
            [source],
        )
        statuses = {row[0]: (row[1], row[2]) for row in cur.fetchall()}
    assert statuses == {"evt-0": ("done", 0), "evt-1": ("dead", 1), "evt-2": ("pending", 0)}
    assert sorted(Payment.objects.values_list("principal", flat=True)) == ["evt-0", "evt-1"]
