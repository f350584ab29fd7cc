"""A view that closes the request's connection: plain, under ATOMIC_REQUESTS, and async under
Django's ASGI handler."""

from __future__ import annotations

import json
import logging
import uuid

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import AsyncClient, Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from tests.django.test_django import post, stored_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]

ALICE = "Bearer alice-token"


def close_after_write(request: HttpRequest) -> HttpResponse:
    payment = Payment.objects.create(principal="t", amount=1, currency="EUR")
    connection.close()
    return JsonResponse({"id": payment.pk}, status=201)


def close_then_query(request: HttpRequest) -> HttpResponse:
    Payment.objects.create(principal="t", amount=1, currency="EUR")
    connection.close()
    return JsonResponse({"count": Payment.objects.count()}, status=201)


def close_and_answer_503(request: HttpRequest) -> HttpResponse:
    # A view that resets the connection after a failure of its own and says so.
    Payment.objects.create(principal="t", amount=1, currency="EUR")
    connection.close()
    return JsonResponse({"error": "try again"}, status=503)


def _write_and_close() -> int:
    payment = Payment.objects.create(principal="t", amount=1, currency="EUR")
    connection.close()
    return int(payment.pk)


async def close_async(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"id": await sync_to_async(_write_and_close)()}, status=201)


def plain(request: HttpRequest) -> HttpResponse:
    payment = Payment.objects.create(principal="t", amount=1, currency="EUR")
    return JsonResponse({"id": payment.pk}, status=201)


urlpatterns = [
    path("close-after-write", close_after_write),
    path("close-then-query", close_then_query),
    path("close-and-answer-503", close_and_answer_503),
    path("close-async", close_async),
    path("plain", plain),
]


@pytest.mark.parametrize("route", ["/close-after-write", "/close-then-query"])
def test_a_view_that_closes_the_connection_is_a_problem_answer_not_its_success(
    route: str, atomic_requests: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Closing the connection rolls the request's transaction back on the server: the view's
    # payment was gone while the client was told 201 (or Django's 500 page, for a query after).
    client = Client(raise_request_exception=False)
    key = uuid.uuid4().hex
    with caplog.at_level(logging.ERROR, logger="pgonce"):
        for _ in range(2):  # the key stays free: the retry runs the view again
            refused = post(client, route, key)
            assert refused.status_code == 500
            assert refused.headers["Content-Type"] == "application/problem+json"
            assert json.loads(refused.content)["title"] == "Transaction ended by the endpoint"
    assert "closed its connection" in caplog.text
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


def test_a_view_that_closes_the_connection_and_answers_a_5xx_keeps_its_answer() -> None:
    client = Client(raise_request_exception=False)
    key = uuid.uuid4().hex
    for _ in range(2):
        answered = post(client, "/close-and-answer-503", key)
        assert answered.status_code == 503
        assert json.loads(answered.content) == {"error": "try again"}
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0


def test_an_async_view_that_closes_the_connection_is_a_problem_answer() -> None:
    client = AsyncClient(raise_request_exception=False)
    headers = {"Authorization": ALICE, "Idempotency-Key": uuid.uuid4().hex}
    for _ in range(2):
        refused = async_to_sync(client.post)(
            "/close-async", b"{}", content_type="application/json", headers=headers
        )
        assert refused.status_code == 500
        assert json.loads(refused.content)["title"] == "Transaction ended by the endpoint"
    assert Payment.objects.count() == 0
    assert stored_keys(headers["Idempotency-Key"]) == 0
