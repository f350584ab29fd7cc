"""Inbox handlers that use Django's transaction machinery: on_commit hooks run once, only for
the events marked done; a durable block or a commit in a handler fails that event alone."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection, transaction

from examples.django_payments.payments.models import Payment
from pgonce.contrib.django.inbox import process_batch
from pgonce.contrib.django.outbox import enqueue
from tests.django.test_django import _deliver, scalar

pytestmark = pytest.mark.django_db(transaction=True)


def test_handlers_hooks_run_after_the_batch_commits_and_misuse_fails_its_event_alone() -> None:
    source = f"probe-{uuid.uuid4().hex[:8]}"
    kinds = ["hook", "hook-then-raise", "durable", "commit", "enqueue"]
    _deliver(*({"kind": kind} for kind in kinds), source=source)
    ran: list[str] = []
    aggregate = uuid.uuid4().hex

    def handler(event: Any) -> None:
        kind = event.payload["kind"]
        Payment.objects.create(principal=kind, amount=1, currency="EUR")
        if kind == "hook":
            transaction.on_commit(lambda: ran.append(kind))
        elif kind == "hook-then-raise":
            transaction.on_commit(lambda: ran.append(kind))
            raise ValueError("the handler failed after registering its hook")
        elif kind == "durable":
            with transaction.atomic(durable=True):  # Django refuses it inside the batch's block
                pass
        elif kind == "commit":
            connection.commit()  # Django refuses it inside the batch's block
        else:
            enqueue("probe", aggregate, "probe.handled", {"kind": kind})

    assert process_batch(source, handler, now=datetime.now(UTC)) == 5
    assert ran == ["hook"]  # once, after the batch committed; the failed event's never
    assert sorted(Payment.objects.values_list("principal", flat=True)) == ["enqueue", "hook"]
    assert scalar("SELECT count(*) FROM pgonce.outbox WHERE aggregateid = %s", aggregate) == 1
    with connection.cursor() as cur:
        cur.execute(
            "SELECT event_id, status, attempts, last_error FROM pgonce.inbox"
            " WHERE source = %s ORDER BY event_id",
            [source],
        )
        rows = cur.fetchall()
    statuses = {row[0]: (row[1], row[2]) for row in rows}
    assert statuses == {
        "evt-0": ("done", 0),
        "evt-1": ("pending", 1),
        "evt-2": ("pending", 1),
        "evt-3": ("pending", 1),
        "evt-4": ("done", 0),
    }
    errors = {row[0]: row[3] for row in rows}
    assert errors["evt-2"].startswith("RuntimeError: A durable atomic block")
    assert errors["evt-3"].startswith("TransactionManagementError")
