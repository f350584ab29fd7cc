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
