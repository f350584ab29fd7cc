"""A view marked ``@transaction.non_atomic_requests`` under ``ATOMIC_REQUESTS``: Django runs it
without its request block, so the middleware's transaction is the view's. Its writes commit with
the stored answer; marked for rollback, nothing of it commits and nothing is stored; its
``select_for_update()`` runs in that transaction (without pgonce Django refuses it outside one)."""

from __future__ import annotations

import json
import uuid

import pytest
from django.db import transaction
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import Client
from django.urls import path

from examples.django_payments.payments.models import Payment
from tests.django.test_django import post, stored_keys

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.urls(__name__)]


@transaction.non_atomic_requests  # type: ignore[untyped-decorator]
def pay(request: HttpRequest) -> HttpResponse:
    payment = Payment.objects.create(principal="n", amount=1, currency="EUR")
    locked = Payment.objects.select_for_update().get(pk=payment.pk)
    if request.GET.get("undo"):
        transaction.set_rollback(True)
        return JsonResponse({"saved": False}, status=200)
    return JsonResponse({"id": locked.pk}, status=201)


urlpatterns = [path("pay", pay)]


# conftest's `atomic_requests`, with ATOMIC_REQUESTS on only.
atomic_requests_on = pytest.mark.parametrize("atomic_requests", [True], indirect=True)


@atomic_requests_on
@pytest.mark.usefixtures("atomic_requests")
def test_a_non_atomic_view_commits_with_the_stored_answer_once() -> None:
    client = Client()
    key = uuid.uuid4().hex
    first = post(client, "/pay", key)
    assert first.status_code == 201
    again = post(client, "/pay", key)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert list(Payment.objects.values_list("pk", flat=True)) == [json.loads(first.content)["id"]]
    assert stored_keys(key) == 1


@atomic_requests_on
@pytest.mark.usefixtures("atomic_requests")
def test_a_non_atomic_view_marked_for_rollback_keeps_nothing_and_stores_nothing() -> None:
    client = Client()
    key = uuid.uuid4().hex
    for _ in range(2):
        answer = post(client, "/pay?undo=1", key)
        assert answer.status_code == 200
        assert "Idempotent-Replayed" not in answer.headers
    assert Payment.objects.count() == 0
    assert stored_keys(key) == 0
