"""An inbox handler that closes the batch's connection: told as the misuse it is, not as a
database that went away, and the batch's events are claimed again by the next batch."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from django.db import connection

from examples.django_payments.payments.models import Payment
from pgonce.contrib.django.inbox import process_batch
from pgonce.errors import DatabaseUnavailable, UsageError
from tests.django.test_django import _deliver

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_handler_that_closes_the_connection_is_a_usage_error_and_the_events_run_again() -> None:
    # It was DatabaseUnavailable ("the connection is closed"), sending operators after an
    # outage that never happened.
    source = f"probe-{uuid.uuid4().hex[:8]}"
    _deliver({"kind": "a"}, {"kind": "close"}, {"kind": "b"}, source=source)
    closing = True

    def handler(event: Any) -> None:
        Payment.objects.create(principal=event.payload["kind"], amount=1, currency="EUR")
        if event.payload["kind"] == "close" and closing:
            connection.close()

    with pytest.raises(UsageError, match="closed the connection") as raised:
        process_batch(source, handler, now=datetime.now(UTC))
    assert not isinstance(raised.value, DatabaseUnavailable)
    assert isinstance(raised.value.__cause__, DatabaseUnavailable)
    assert Payment.objects.count() == 0
    closing = False
    assert process_batch(source, handler, now=datetime.now(UTC)) == 3
    assert sorted(Payment.objects.values_list("principal", flat=True)) == ["a", "b", "close"]
