"""POST /payments three ways (a plain view, Django REST Framework, an async view), each writing
with the ORM. The Idempotency-Key middleware runs each one inside the claim's transaction: the
payment row commits with the key and the stored response, or neither does."""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from examples.django_payments.payments.auth import principal_of
from examples.django_payments.payments.models import Payment
from examples.django_payments.payments.services import record_payment
from pgonce.http.problem import CONTENT_TYPE, problem_body


def problem(status: int, title: str, detail: str) -> HttpResponse:
    return HttpResponse(
        problem_body(status, title, detail), status=status, content_type=CONTENT_TYPE
    )


def _parsed(request: HttpRequest) -> tuple[str, dict[str, Any]] | HttpResponse:
    """The principal and the payment asked for, or the problem answer (before any query)."""
    who = principal_of(request.META.get("HTTP_AUTHORIZATION"))
    if who is None:
        return problem(401, "Unauthorized", "a valid bearer token is required")
    try:
        data = json.loads(request.body)
        amount, currency = data["amount"], data["currency"]
    except (ValueError, TypeError, KeyError):
        return problem(422, "Invalid request", "the body does not describe a payment")
    valid_amount = type(amount) is int and amount > 0
    if not valid_amount or not isinstance(currency, str) or len(currency) != 3:
        return problem(422, "Invalid request", "the body does not describe a payment")
    return who, {"amount": amount, "currency": currency}


def _created(payment: Payment) -> JsonResponse:
    body = {
        "id": payment.pk,
        "amount": payment.amount,
        "currency": payment.currency,
        "created_at": payment.created_at.isoformat(),
    }
    return JsonResponse(body, status=201, headers={"Location": f"/payments/{payment.pk}"})


# --8<-- [start:view]
def create_payment(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return problem(405, "Method Not Allowed", "POST a payment")
    parsed = _parsed(request)  # 401 or 422 before any query: such answers are not stored
    if isinstance(parsed, HttpResponse):
        return parsed
    who, fields = parsed
    return _created(record_payment(who, fields["amount"], fields["currency"]))


# --8<-- [end:view]


async def create_payment_async(request: HttpRequest) -> HttpResponse:
    parsed = _parsed(request)
    if isinstance(parsed, HttpResponse):
        return parsed
    who, fields = parsed
    return _created(await Payment.objects.acreate(principal=who, **fields))


def get_payment(request: HttpRequest, payment_id: int) -> HttpResponse:
    who = principal_of(request.META.get("HTTP_AUTHORIZATION"))
    payment = Payment.objects.filter(pk=payment_id, principal=who).first()
    if payment is None:
        return problem(404, "Not Found", "no such payment")
    return JsonResponse({"id": payment.pk, "amount": payment.amount, "currency": payment.currency})


def health(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"ok": True})


class PaymentSerializer(serializers.ModelSerializer):
    amount = serializers.IntegerField(min_value=1)
    currency = serializers.CharField(min_length=3, max_length=3)

    class Meta:
        model = Payment
        fields = ("id", "amount", "currency", "created_at")
        read_only_fields = ("id", "created_at")


class PaymentList(APIView):
    """DRF: authentication, permission and validation answer before any query (not stored)."""

    def post(self, request: Request) -> Response:
        serializer = PaymentSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        serializer.save(principal=request.user.name)
        return Response(
            serializer.data, status=201, headers={"Location": f"/payments/{serializer.data['id']}"}
        )
