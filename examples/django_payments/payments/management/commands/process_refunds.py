"""``python manage.py process_refunds``: the refund webhooks in the inbox, handled with the ORM.

Each handler runs in a savepoint of the transaction that marks its event done, so the refund row
and the event's "done" commit together; a handler that raises is rolled back to its savepoint and
retried later with backoff. Several processes may run the command at once.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from examples.django_payments.payments.models import Refund
from pgonce.contrib.django.inbox import process_batch
from pgonce.core.inbox import InboxEvent


# --8<-- [start:command]
def on_refund(event: InboxEvent) -> None:
    Refund.objects.create(
        event_id=event.id, payment_id=event.payload["payment"], amount=event.payload["amount"]
    )


class Command(BaseCommand):
    help = "Handle the refund events waiting in the inbox; return when none is due."

    def handle(self, *args: Any, **options: Any) -> None:
        handled = 0
        while claimed := process_batch("refunds", on_refund, limit=50):
            handled += claimed
        self.stdout.write(f"{handled} refund event(s) handled")


# --8<-- [end:command]
