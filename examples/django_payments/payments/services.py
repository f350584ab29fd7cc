"""What the views write, as a function: a payment and the event that tells the others about it.

The event goes through pgonce's outbox: its row commits exactly when the payment does (``pgonce
relay`` publishes it afterwards), so no subscriber hears of a payment that was rolled back. Inside
a view behind the Idempotency-Key middleware, ``atomic()`` below is a savepoint in the request's
transaction, and the payment, its event, the claim and the stored response commit together.
"""

from __future__ import annotations

from django.db import transaction

from examples.django_payments.payments.models import Payment
from pgonce.contrib.django.outbox import enqueue


# --8<-- [start:record]
def record_payment(principal: str, amount: int, currency: str) -> Payment:
    with transaction.atomic():
        payment: Payment = Payment.objects.create(
            principal=principal, amount=amount, currency=currency
        )
        enqueue(
            "payment",
            str(payment.pk),
            "payment.created",
            {"amount": amount, "currency": currency},
        )
    return payment


# --8<-- [end:record]
