"""A payment: one row per payment really made (what the tests count)."""

from __future__ import annotations

from django.db import models


class Payment(models.Model):
    principal = models.TextField()
    amount = models.BigIntegerField()
    currency = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        app_label = "payments"
        db_table = "payments"


class Refund(models.Model):
    """A refund, written by the inbox handler of the ``refunds`` source (one per event)."""

    event_id = models.TextField(unique=True)
    payment = models.ForeignKey(Payment, on_delete=models.PROTECT)
    amount = models.BigIntegerField()

    class Meta:
        app_label = "payments"
        db_table = "refunds"
