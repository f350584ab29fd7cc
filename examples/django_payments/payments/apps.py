from __future__ import annotations

from django.apps import AppConfig


class PaymentsConfig(AppConfig):
    name = "examples.django_payments.payments"
    label = "payments"
